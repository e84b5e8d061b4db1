"""`LocalEngine`: in-process PyTorch generation with continuous batching. The embedded default.

A worker thread owns the model. Requests join the running batch between decode steps: each new
prompt is prefilled once (a GRPO group that arrives together shares that prefill: its KV rows are
copied to every sample's slot), then every running sequence advances one token per step in one
batched forward over a slot KV cache. Finished sequences leave the batch at once, so a long-tailed
group does not hold short ones hostage.

Weight updates and pauses take effect between steps (at a token boundary): `load_weights` takes
the step lock (callers waiting for it go before the worker's next step), so no forward ever mixes two
policies, and every token is stamped with the version of the weights that sampled it. Running
sequences then continue with the new weights (partial rollout); with kv_on_update="recompute" their
KV cache is first rebuilt under the new weights.
LoRA adapters (relayrl.trainer.lora) arrive the same way and are merged into a copy of the base weights.
fp32 weights arriving at a bf16 engine are rounded stochastically (weight_rounding="stochastic"): rounded to
nearest, updates smaller than half a bf16 step would never reach it (relayrl.trainer.optim.round_to_bf16_).

Memory: `kv_cache_bytes` caps the slot KV cache (slots x length x bytes per token): a request joins the batch
only while the grown cache still fits, the rest wait in the queue (never dropped), so eval sets of any size or
long prompts run in a bounded cache. Without it, max_batch_size and max_tokens_in_flight bound the batch.
(Parked prefixes of finished trajectories are copies outside the cache, bounded by prefix_cache_size.)

A finished request that names a trajectory (`rid`) leaves its KV cache parked; the trajectory's next
turn (a prompt that extends the parked tokens) reuses it and prefills only the new tokens.

Devices: the engine runs where its model is (`self.device`, the model's first parameter): the KV cache, input
ids, positions, masks and the sampling buffer are created there. Random numbers are drawn on the CPU from CPU
generators (relayrl.engine.sampling says why). The C decode kernel is CPU-only; on a GPU decode runs on SDPA, and each
decode step is replayed as a CUDA graph (relayrl.engine.decode_graphs; `cuda_graphs=False` turns it off).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file

from relayrl.common.device import avoid_cudnn_attention, model_device
from relayrl.common.threads import release_openmp_threads
from relayrl.config.engine import EngineConfig
from relayrl.engine import attention, direct, routing, skinny
from relayrl.engine import linear as engine_linear
from relayrl.engine.base import GenOutput, InferenceEngine, SamplingParams, TokenCallback
from relayrl.engine.batching import BatchStep
from relayrl.engine.decode_graphs import StaticDecode
from relayrl.engine.prefill import SharedStart
from relayrl.engine.priority import URGENT, UrgentSeq, enqueue
from relayrl.engine.score_queue import ScoreQueue
from relayrl.engine.scoring import Scored
from relayrl.engine.sequence import Seq, resolve
from relayrl.engine.stops import Decode
from relayrl.engine.vision import EngineVision, keyed_prompt
from relayrl.engine.weights import EngineWeights, stored_in_float32
from relayrl.models import eos_token_ids, load_model, load_tokenizer, resolve_model_path
from relayrl.models.moe import model_names
from relayrl.models.vision import Images

log = logging.getLogger(__name__)


KV_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LocalEngine(BatchStep, InferenceEngine):
    """Continuous-batching generation over a Hugging Face causal LM held in this process (the step itself:
    relayrl.engine.batching)."""

    def __init__(self, model: torch.nn.Module, *, eos_token_ids: Iterable[int], max_batch_size: int = 64,
                 max_seq_len: int | None = None, seed: int = 0, max_tokens_in_flight: int | None = None,
                 prefix_cache_size: int = 64, kv_on_update: str = "recompute", attention: str = "auto",
                 owns_weights: bool = True, kv_cache_bytes: int | None = None, weight_rounding: str = "stochastic",
                 cuda_graphs: bool = True, linear: str = "auto", prefill_tokens: int = 2048,
                 skinny_rows: int | None = None, kv_dtype: str = "auto", stage_weights: bool = True,
                 decode: Decode | None = None):
        if kv_on_update not in ("recompute", "keep"):
            raise ValueError(f"kv_on_update must be 'recompute' or 'keep', got {kv_on_update!r}")
        if attention not in ("auto", "kernel", "sdpa"):
            raise ValueError(f"attention must be 'auto', 'kernel' or 'sdpa', got {attention!r}")
        if linear not in ("auto", "onednn", "default"):
            raise ValueError(f"linear must be 'auto', 'onednn' or 'default', got {linear!r}")
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {sorted(KV_DTYPES)}, got {kv_dtype!r}")
        cfg = model.config.get_text_config()  # a vision-language model's text model (relayrl.engine.vision)
        self.model = model.eval()
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        # the tokenizer's decode, for stop strings (relayrl.engine.stops); only this engine's worker calls it
        self.decode = decode
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len or int(getattr(cfg, "max_position_embeddings", 4096))
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.device = model_device(model)
        avoid_cudnn_attention(self.device)
        self.linear = engine_linear.choose(model, linear)  # the LM head's library: "onednn" or "default"
        # few-row fp32 linears through a C kernel (relayrl.engine.skinny); a forced `linear` library means it alone
        self.skinny_rows = skinny.choose(model, skinny_rows if skinny_rows is not None or linear == "auto" else 0)
        if kv_cache_bytes is not None and kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be > 0, got {kv_cache_bytes}")
        # grown on the first admission to what the batch needs: start at one small slot. kv_dtype "auto": the
        # model's dtype; a narrower one (an fp32 model's bf16 cache) holds twice the tokens per byte, rounded
        cache_dtype = KV_DTYPES[kv_dtype] or next(model.parameters()).dtype
        self.cache = routing.slot_cache(model, cfg.num_hidden_layers, kv_heads, head_dim, cache_dtype, slots=1,
                                        length=64, device=self.device)
        self.kv_cache_bytes = kv_cache_bytes
        self.weights = EngineWeights(model, seed=seed, rounding=weight_rounding, owned=owns_weights)
        self.stage_updates = stage_weights  # stage_weights(): move and round an update before pausing for it
        self._generator = torch.Generator().manual_seed(seed)  # a CPU generator on any device (sampling.py)
        self._sample_work = torch.empty(0, device=self.device)  # sampling's float32 scratch, grown as needed
        self.max_tokens_in_flight, self.kv_on_update = max_tokens_in_flight, kv_on_update
        self.prefill_tokens = prefill_tokens  # padded tokens per prefill forward (relayrl.engine.prefill; 0: one row)
        self._start = SharedStart()  # the KV of the last start several prompts shared (cleared with the weights)
        self.vision = EngineVision.for_model(model)  # a vision-language model's images (relayrl.engine.vision)
        self._parked: OrderedDict[str, tuple[list[int], list[torch.Tensor]]] = OrderedDict()
        self.prefix_cache_size = prefix_cache_size
        self._waiting: deque[Seq] = deque()
        self._scores = ScoreQueue()  # submit_score's
        self._active: list[Seq] = []  # index = KV slot
        self._cond = threading.Condition()
        self._step_lock = threading.Lock()  # held by the worker for each step, by others via _between_steps
        # callers of _between_steps that arrived / were served: a step waits for those who arrived before it
        self._arrived = self._served = 0
        self.waited_steps = 0  # steps the last _between_steps caller waited through (tests/unit/test_engine.py)
        self._paused = False
        self._closed = False
        self._version = 0
        self._thread: threading.Thread | None = None
        self.stats = {"generated_tokens": 0, "prefill_tokens": 0, "prefills": 0, "steps": 0, "decode_rows": 0,
                      "busy_s": 0.0, "reused_tokens": 0, "aborted": 0, "scored_tokens": 0}
        self._static: StaticDecode | None = None
        self.direct = False  # fused decode steps skip the HF module tree (relayrl.engine.direct; set by _use_kernel)
        if attention != "sdpa":
            self._use_kernel(attention == "kernel", cfg.num_attention_heads, kv_heads, head_dim)
        # on a GPU, decode steps replay as CUDA graphs (relayrl.engine.decode_graphs says why)
        self._static = (StaticDecode(self.model, self.cache, max_batch_size, capture=True,
                                     max_cache_bytes=kv_cache_bytes)
                        if cuda_graphs and self.device.type == "cuda" and self.cache.kernel is None else None)
        # before the worker's first op: the caller (which loaded the model) waits while the worker decodes
        release_openmp_threads()

    @classmethod
    def from_config(cls, e: EngineConfig, model: torch.nn.Module, *, eos_token_ids: Iterable[int], seed: int = 0,
                    decode: Decode | None = None, owns_weights: bool = True) -> LocalEngine:
        """An engine on `model` as the engine section sets it, resolved (relayrl.run.resolve: kv_dtype is a dtype;
        attention "auto" on a CPU is this engine's own rule, `_use_kernel`). A new engine knob: its field in
        EngineConfig and its line here."""
        return cls(model, eos_token_ids=eos_token_ids, seed=seed, decode=decode, owns_weights=owns_weights,
                   max_batch_size=e.max_batch_size, max_seq_len=e.max_seq_len,
                   max_tokens_in_flight=e.max_tokens_in_flight, prefix_cache_size=e.prefix_cache_size,
                   kv_on_update=e.kv_on_update, attention=e.attention, weight_rounding=e.weight_rounding,
                   stage_weights=e.stage_weights, cuda_graphs=e.cuda_graphs, prefill_tokens=e.prefill_tokens,
                   kv_dtype=e.kv_dtype, kv_cache_bytes=None if e.kv_cache_gb is None else int(e.kv_cache_gb * 1e9))

    @classmethod
    def from_pretrained(cls, path: str, *, dtype: str = "bfloat16", device: str | torch.device = "cpu",
                        **kwargs) -> LocalEngine:
        """`device`: auto, cpu, cuda or cuda:N (relayrl.common.device.resolve_device)."""
        model = load_model(path, dtype=dtype, device=device)
        engine = cls(model, eos_token_ids=eos_token_ids(load_tokenizer(path), path), decode=tokenizer_decode(path),
                     **kwargs)
        engine.round_in_fp32_weights(path)
        return engine

    def round_in_fp32_weights(self, path: str) -> bool:
        """A bf16 engine on a folder stored in fp32 (a model relayrl trained) reads the weights again and rounds them
        stochastically, as weight sync does. Loaded rounded to nearest, a fine-tune's updates smaller than half a
        bf16 step vanish and the engine evaluates or serves a model close to the one training started from, far
        below what the run's own evaluations reported (docs/benchmarks.md, "A curriculum of planted wrong first
        answers"). Returns whether it did."""
        bf16 = next(self.model.parameters()).dtype == torch.bfloat16
        if not bf16 or self.weights.rounding != "stochastic":
            return False
        path = resolve_model_path(path, prepare=False)  # an alias or hub id: its folder
        if not stored_in_float32(path):
            return False
        self.load_weights_from_disk(path, self._version)
        log.info("engine: fp32 weights of %s rounded stochastically into bf16", path)
        return True

    # ---- public API ---------------------------------------------------------------------------
    @property
    def owns_weights(self) -> bool:
        """False when the model is the trainer's own (colocated sync RL in the trainer's dtype): never released."""
        return self.weights.owned

    @property
    def version(self) -> int:
        return self._version

    def submit(self, input_ids: list[int], params: SamplingParams, rid: str | None = None,
               on_token: TokenCallback | None = None, images: Images = ()) -> concurrent.futures.Future:
        """Queue one generation; the future resolves to a GenOutput. `rid` names the trajectory (KV reuse, abort).
        `on_token` streams the request: it gets each token as it is sampled (relayrl.engine.base.TokenCallback).
        `images`: a vision-language prompt's image files, in the order of its image placeholders. Submitted under
        relayrl.engine.priority.URGENT (an evaluation beside a producer), it waits ahead of the plain requests."""
        if not input_ids:
            raise ValueError("input_ids is empty")
        if params.stop_strings and self.decode is None:
            raise ValueError("stop_strings need the tokenizer's decode: build the LocalEngine with decode=...")
        if len(input_ids) >= self.max_seq_len:
            raise ValueError(f"prompt of {len(input_ids)} tokens does not fit max_seq_len={self.max_seq_len}")
        kv = self._kv_len(len(input_ids), params.max_new_tokens) * self.cache.bytes_per_token
        if self.kv_cache_bytes and kv > self.kv_cache_bytes:
            raise ValueError(f"a prompt of {len(input_ids)} tokens + max_new_tokens={params.max_new_tokens} needs "
                             f"{kv / 1e9:.4f} GB of KV cache alone, more than the budget of "
                             f"{self.kv_cache_bytes / 1e9:.4f} GB (engine.kv_cache_gb)")
        stop = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        seq = (UrgentSeq if URGENT.get() else Seq)(list(input_ids), params, concurrent.futures.Future(), stop, gen,
                                                   rid=rid, on_token=on_token)
        with self._cond:
            if self._closed:
                raise RuntimeError("LocalEngine is closed")
            seq.prompt = keyed_prompt(self.vision, seq.prompt, images)  # under _cond, as the worker's prune runs
            enqueue(self._waiting, seq)
            self._ensure_thread()
            self._cond.notify()
        return seq.future

    async def agenerate(self, input_ids: list[int], params: SamplingParams, rid: str | None = None,
                        on_token: TokenCallback | None = None, images: Images = ()) -> GenOutput:
        """Generate; cancelling the awaiting task frees the request's slot at the next step."""
        return await asyncio.wrap_future(self.submit(input_ids, params, rid, on_token, images))

    def submit_score(self, input_ids: list[int], top_k: int = 0, temperature: float = 1.0) -> concurrent.futures.Future:
        """Queue the scoring of `input_ids` under the current weights; the future resolves to (logprobs, alternatives):
        for each token after the first, log_softmax(logits / temperature)[token] given the tokens before it, and the
        top_k most likely (token, logprob) there. What prompt logprobs report (OpenAI's echo, SGLang's
        input_token_logprobs). The worker runs it between two steps as one plain forward (decoder, then the LM head
        in fp32, as the trainer computes logprobs), so it never races a decode step or a weight update and does not
        depend on what the KV cache holds (shared or parked prefixes, a narrower cache dtype)."""
        ScoreQueue.check(input_ids, top_k, temperature, self.max_seq_len)
        with self._cond:
            if self._closed:
                raise RuntimeError("LocalEngine is closed")
            future = self._scores.put(input_ids, top_k, temperature)
            self._ensure_thread()
            self._cond.notify()
        return future

    def score(self, input_ids: list[int], top_k: int = 0, temperature: float = 1.0) -> Scored:
        """Blocking submit_score."""
        return self.submit_score(input_ids, top_k, temperature).result()

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[GenOutput]:
        """Blocking batch generation (convenience for scripts and tests)."""
        futures = [self.submit(p, params) for p in prompts]
        return [f.result() for f in futures]

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy new weights in place between two decode steps and stamp later tokens with `version`
        (relayrl.engine.weights: LoRA adapters merged, fp32 into bf16 rounded stochastically)."""
        with self._between_steps():
            self.weights.write(named_tensors, version)
            self._version = version
            self._parked.clear()  # parked KV was computed by the old weights
            self._start.clear()
            if self.kv_on_update == "recompute":
                for seq in self._active:
                    seq.refill = True

    def stage_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                      version: int) -> list[tuple[str, torch.Tensor]]:
        """An update made ready while this engine keeps generating (EngineWeights.stage: moved to its device and
        rounded into its dtype), so that `load_weights` pauses it only for a copy. An idle engine loses nothing
        to a pause: its update is passed as it is, with no second copy of the weights (colocated sync runs)."""
        if not self.stage_updates or not self.num_running():
            return list(named_tensors)
        return self.weights.stage(named_tensors, version)

    def load_weights_from_disk(self, path: str, version: int) -> None:
        """Load every *.safetensors file of a folder (e.g. a saved HF model) as new weights."""
        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors files in {path}")
        tensors = model_names({k: v for f in files for k, v in load_file(str(f)).items()})  # MoE: fused
        self.load_weights(self.stage_weights(tensors.items(), version), version)

    def abort(self, rid: str | None = None) -> int:
        """Finish the matching requests (all if rid is None) now, with finish_reason "abort" and the
        tokens generated so far; returns how many were aborted."""
        with self._between_steps(), torch.inference_mode():
            with self._cond:
                hit = [q for q in self._waiting if rid is None or q.rid == rid]
                for q in hit:
                    self._waiting.remove(q)
            for q in hit:
                resolve(q, q.output("abort"))
            slots = [i for i, q in enumerate(self._active) if rid is None or q.rid == rid]
            for i in reversed(slots):
                q = self._release(i)
                resolve(q, q.output("abort"))
            self.stats["aborted"] += len(hit) + len(slots)
            return len(hit) + len(slots)

    def release_memory(self, weights: bool = True) -> int:
        """Give back the KV cache, parked prefixes and (weights=True) the weight storage while the trainer in
        this process needs the memory (colocated synchronous RL: the engine is idle while training). The next
        `load_weights` must send every weight; it reallocates them. An engine still serving live requests
        keeps its memory (returns 0). Returns the bytes released."""
        with self._between_steps(), torch.inference_mode():
            self._drop_cancelled()  # e.g. over-sampled groups the scheduler dropped: nobody waits for them
            with self._cond:
                self._waiting = deque(q for q in self._waiting if not q.future.cancelled())
            self._parked.clear()
            self._start.clear()
            if self._active or self._waiting:  # someone still generates: keep what their requests use
                return 0
            freed = self.cache.release()
            if weights and (weights_freed := self.weights.release()):
                freed += weights_freed
                if self._static is not None:
                    self._static.reset()  # recorded graphs read this storage; load_weights allocates anew
            return freed

    def flush_cache(self) -> None:
        """Forget parked KV (finished trajectories' prefixes) and the kept shared start."""
        with self._between_steps():
            self._parked.clear()
            self._start.clear()

    def set_version(self, version: int) -> None:
        with self._between_steps():
            self._version = version

    def rng_state(self) -> torch.Tensor:
        """State of the generator that samples requests without a seed (saved in checkpoints)."""
        return self._generator.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        with self._between_steps():
            self._generator.set_state(state)

    @contextlib.contextmanager
    def _between_steps(self) -> Iterator[None]:
        """The step lock, for a caller, between two of the worker's steps. The worker lets every caller that
        arrived before its next step go first: it never blocks between its steps, so it used to take the lock
        straight back after each one, and a caller got it only when the OS woke it in that gap (with a few busy
        Python threads, seconds later). Callers arriving meanwhile wait for that step: a flood of them (a client
        aborting in a loop) cannot stop generation."""
        with self._cond:
            self._arrived += 1
            arrived_at = self.stats["steps"]
        try:
            with self._step_lock:
                # steps that began after this caller arrived: 0 or 1 (the one in progress), whatever the load
                self.waited_steps = self.stats["steps"] - arrived_at
                yield
        finally:
            with self._cond:
                self._served += 1
                self._cond.notify()

    def pause(self) -> None:
        """Stop stepping after the current token; running sequences keep their state."""
        with self._between_steps(), self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify()

    def num_running(self) -> int:
        return len(self._active) + len(self._waiting)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for future in [seq.future for seq in list(self._waiting) + self._active]:
            if not future.done():
                future.set_exception(RuntimeError("LocalEngine closed"))
        self._waiting.clear()
        self._scores.fail(RuntimeError("LocalEngine closed"))
        self._active.clear()

    @property
    def cuda_graphs(self) -> bool:
        """Whether decode steps replay as CUDA graphs (a GPU engine, unless turned off or recording failed)."""
        return self._static is not None and self._static.failed is None

    @property
    def attention(self) -> str:
        """How decode steps attend: "kernel" (relayrl.engine.attention) or "sdpa"."""
        return "kernel" if self.cache.kernel is not None else "sdpa"

    def _use_kernel(self, required: bool, heads: int, kv_heads: int, head_dim: int) -> None:
        """Route decode attention through the C kernel when the model is on the CPU, the kernel builds, fits the
        model and the model sends its attention calls to it (checked on one real decode step); else SDPA (the
        reason logged), or an error when `required`."""
        why = attention.why_not_kernel(self.model, self.cache.dtype, heads, kv_heads, head_dim)
        if why is None:
            self.cache.kernel = attention.load_kernel()
            try:  # _forward_decode checks that every layer's attention went through the kernel
                with torch.inference_mode():
                    self._prefill([[0, 0]], [0])
                    self._check_direct(self._forward_decode([0], [2]))
            except RuntimeError as e:
                self.cache.kernel, why = None, str(e)
            self.stats.update(prefill_tokens=0, prefills=0)
        if why and required:
            raise RuntimeError(f"engine.attention=kernel: {why}")
        if why:
            log.info("LocalEngine decode attention: SDPA (%s)", why)

    def _check_direct(self, want: torch.Tensor) -> None:
        """Decode through the written-out step (relayrl.engine.direct) where it covers the model and gives `want`,
        the HF forward's logits of token 0 at position 2 of slot 0; else keep the HF forward (the reason logged)."""
        why = direct.why_not(self.model)
        if why is None:
            self.direct = True
            try:  # a failure here costs the written-out step, not the kernel
                got = self._forward_decode([0], [2])  # rewrites the same key and value at position 2
                if not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
                    why = f"its logits differ from the HF forward's by {(got - want).abs().max():.3g}"
            except RuntimeError as e:
                why = f"it failed: {e}"
            self.direct = why is None
        if why:
            log.info("LocalEngine decode step: the HF forward (%s)", why)

    # ---- worker -------------------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="relayrl-local-engine", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                ahead = self._arrived  # callers waiting now go before this step; later ones wait for it
                while not self._closed and (self._paused or self._served < ahead
                                            or not (self._waiting or self._active or self._scores)):
                    self._cond.wait()
                if self._closed:
                    return
                new = self._take_admissible()
                if self.vision is not None:  # forget the images no prompt in the engine refers to any more
                    self.vision.prune([s.prompt for s in [*self._waiting, *new, *self._active]]
                                      + [t for t, _ in self._parked.values()] + [self._start.tokens])
                scores = self._scores.take(self.prefill_tokens)
            with self._step_lock, torch.inference_mode():  # the worker's own: the others use _between_steps
                t0 = time.perf_counter()
                try:
                    self.stats["scored_tokens"] += ScoreQueue.run(self.model, scores)
                    self._drop_cancelled()
                    self._refill()
                    self._admit([q for q in new if not q.future.cancelled()])
                    if self._active:
                        self._decode_step()
                except Exception as e:  # a failed forward fails its requests, not the engine
                    for seq in new + self._active:
                        if not seq.future.done():
                            seq.future.set_exception(e)
                    self._active.clear()
                self.stats["busy_s"] += time.perf_counter() - t0


def tokenizer_decode(path: str) -> Decode:
    """The `decode` of a LocalEngine for the model at `path` (stop strings): a tokenizer of the engine's own, since
    its worker decodes with it while agents and servers tokenize with theirs. Loaded at the first stop string, so
    an engine no request asks to stop on text never reads it (a bench's weights-only folder has none to read)."""
    tok = None

    def decode(ids: list[int]) -> str:
        nonlocal tok
        if tok is None:
            tok = load_tokenizer(path)
        return tok.decode(ids, skip_special_tokens=True)
    return decode

