"""`LocalEngine`: in-process PyTorch generation with continuous batching. The embedded default.

A worker thread owns the model. Requests join the running batch between decode steps: each new
prompt is prefilled once (a GRPO group that arrives together shares that prefill: its KV rows are
copied to every sample's slot), then every running sequence advances one token per step in one
batched forward over a slot KV cache. Finished sequences leave the batch at once, so a long-tailed
group does not hold short ones hostage.

Weight updates and pauses take effect between steps (at a token boundary): `update_weights` takes
the step lock, so no forward ever mixes two policies, and every token is stamped with the version
of the weights that sampled it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from relayrl.engine.base import GenOutput, SamplingParams
from relayrl.engine.kv_cache import SlotKVCache
from relayrl.engine.sampling import sample_tokens


@dataclass
class _Seq:
    prompt: list[int]
    params: SamplingParams
    future: concurrent.futures.Future
    stop_ids: frozenset[int]
    generator: torch.Generator | None
    out_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    kv_len: int = 0  # positions written to the KV cache (the last sampled token is not yet written)
    prompt_logits: torch.Tensor | None = None  # last-position logits of the prompt, for prefix sharing


class LocalEngine:
    """Continuous-batching generation over a Hugging Face causal LM held in this process."""

    def __init__(self, model: torch.nn.Module, *, eos_token_ids: Iterable[int], max_batch_size: int = 64,
                 max_seq_len: int | None = None, seed: int = 0):
        cfg = model.config
        self.model = model.eval()
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len or int(getattr(cfg, "max_position_embeddings", 4096))
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.cache = SlotKVCache(cfg.num_hidden_layers, kv_heads, head_dim, next(model.parameters()).dtype)
        self._params = dict(model.named_parameters())
        self._generator = torch.Generator().manual_seed(seed)
        self._waiting: deque[_Seq] = deque()
        self._active: list[_Seq] = []  # index = KV slot
        self._cond = threading.Condition()
        self._step_lock = threading.Lock()
        self._paused = False
        self._closed = False
        self._version = 0
        self._thread: threading.Thread | None = None
        self.stats = {"generated_tokens": 0, "prefill_tokens": 0, "prefills": 0, "steps": 0, "busy_s": 0.0}

    @classmethod
    def from_pretrained(cls, path: str, *, dtype: str = "bfloat16", **kwargs) -> LocalEngine:
        from relayrl.models import eos_token_ids, load_model, load_tokenizer

        model = load_model(path, dtype=dtype)
        return cls(model, eos_token_ids=eos_token_ids(load_tokenizer(path), path), **kwargs)

    # ---- public API ---------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    def submit(self, input_ids: list[int], params: SamplingParams) -> concurrent.futures.Future:
        """Queue one generation; the future resolves to a GenOutput."""
        if not input_ids:
            raise ValueError("input_ids is empty")
        if len(input_ids) >= self.max_seq_len:
            raise ValueError(f"prompt of {len(input_ids)} tokens does not fit max_seq_len={self.max_seq_len}")
        stop = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        seq = _Seq(list(input_ids), params, concurrent.futures.Future(), stop, gen)
        with self._cond:
            if self._closed:
                raise RuntimeError("LocalEngine is closed")
            self._waiting.append(seq)
            self._ensure_thread()
            self._cond.notify()
        return seq.future

    async def agenerate(self, input_ids: list[int], params: SamplingParams, rid: str | None = None) -> GenOutput:
        return await asyncio.wrap_future(self.submit(input_ids, params))

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[GenOutput]:
        """Blocking batch generation (convenience for scripts and tests)."""
        futures = [self.submit(p, params) for p in prompts]
        return [f.result() for f in futures]

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy new weights in place between two decode steps and stamp later tokens with `version`."""
        with self._step_lock, torch.no_grad():
            for name, tensor in named_tensors:
                if name not in self._params:
                    raise KeyError(f"engine model has no parameter {name!r}")
                self._params[name].copy_(tensor)
            self._version = version

    def set_version(self, version: int) -> None:
        with self._step_lock:
            self._version = version

    def pause(self) -> None:
        """Stop stepping after the current token; running sequences keep their state."""
        with self._step_lock, self._cond:
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
        for seq in list(self._waiting) + self._active:
            if not seq.future.done():
                seq.future.set_exception(RuntimeError("LocalEngine closed"))
        self._waiting.clear()
        self._active.clear()

    # ---- worker -------------------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="relayrl-local-engine", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (self._paused or not (self._waiting or self._active)):
                    self._cond.wait()
                if self._closed:
                    return
                free = self.max_batch_size - len(self._active)
                new = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
            with self._step_lock, torch.inference_mode():
                t0 = time.perf_counter()
                try:
                    self._admit(new)
                    if self._active:
                        self._decode_step()
                except Exception as e:  # a failed forward fails its requests, not the engine
                    for seq in new + self._active:
                        if not seq.future.done():
                            seq.future.set_exception(e)
                    self._active.clear()
                self.stats["busy_s"] += time.perf_counter() - t0

    def _admit(self, new: list[_Seq]) -> None:
        """Prefill each distinct prompt once and give every request its own slot."""
        groups: dict[tuple[int, ...], list[_Seq]] = {}
        for seq in new:
            groups.setdefault(tuple(seq.prompt), []).append(seq)
        need_len = max((len(s.prompt) + s.params.max_new_tokens for s in new), default=0)
        self.cache.ensure(len(self._active) + len(new), min(_round_up(need_len, 64), self.max_seq_len))
        for prompt, seqs in groups.items():
            first = len(self._active)
            twin = self._running_twin(prompt)
            if twin is None:
                logits = self._prefill(list(prompt), first)
                start = 1
            else:  # a sample of the same group is already running: its prompt KV is still intact
                logits, start = self._active[twin].prompt_logits, 0
            for i in range(start, len(seqs)):
                self.cache.copy_slot(first if twin is None else twin, first + i, len(prompt))
            for seq in seqs:
                seq.kv_len = len(prompt)
                seq.prompt_logits = logits
                self._active.append(seq)
            self._sample_and_append(seqs, logits.expand(len(seqs), -1))
        self._retire_finished()

    def _running_twin(self, prompt: tuple[int, ...]) -> int | None:
        """Slot of a running sequence with exactly this prompt (GRPO samples that arrived late)."""
        for slot, seq in enumerate(self._active):
            if len(seq.prompt) == len(prompt) and seq.prompt_logits is not None and tuple(seq.prompt) == prompt:
                return slot
        return None

    def _prefill(self, prompt: list[int], slot: int) -> torch.Tensor:
        n = len(prompt)
        self.cache.prefill_into(slot)
        mask = torch.ones(n, n, dtype=torch.bool).tril_()[None, None]
        out = self.model(input_ids=torch.tensor([prompt]), position_ids=torch.arange(n)[None],
                         attention_mask=mask, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.stats["prefill_tokens"] += n
        self.stats["prefills"] += 1
        return out.logits[:, -1].float()

    def _decode_step(self) -> None:
        seqs = self._active
        positions = torch.tensor([s.kv_len for s in seqs])
        kv_len = int(positions.max()) + 1
        self.cache.decode(positions, kv_len)
        mask = (torch.arange(kv_len)[None, :] <= positions[:, None])[:, None, None, :]
        tokens = torch.tensor([[s.out_ids[-1]] for s in seqs])
        out = self.model(input_ids=tokens, position_ids=positions[:, None], attention_mask=mask,
                         past_key_values=self.cache, use_cache=True)
        for s in seqs:
            s.kv_len += 1
        self.stats["steps"] += 1
        self._sample_and_append(seqs, out.logits[:, -1])
        self._retire_finished()

    def _sample_and_append(self, seqs: list[_Seq], logits: torch.Tensor) -> None:
        tokens, logprobs = sample_tokens(logits, [s.params for s in seqs], [s.generator for s in seqs],
                                         self._generator)
        for seq, tok, lp in zip(seqs, tokens, logprobs):
            seq.out_ids.append(tok)
            seq.logprobs.append(lp)
            seq.versions.append(self._version)
        self.stats["generated_tokens"] += len(seqs)

    def _finish_reason(self, seq: _Seq) -> str | None:
        if seq.out_ids[-1] in seq.stop_ids:
            return "stop"
        if len(seq.out_ids) >= seq.params.max_new_tokens or seq.kv_len + 1 >= self.max_seq_len:
            return "length"
        return None

    def _retire_finished(self) -> None:
        """Resolve finished requests and keep active slots dense (move the last slot into the hole)."""
        for i in range(len(self._active) - 1, -1, -1):
            seq = self._active[i]
            reason = self._finish_reason(seq)
            if reason is None:
                continue
            last = len(self._active) - 1
            if i != last:
                self.cache.copy_slot(last, i, self._active[last].kv_len)
                self._active[i] = self._active[last]
            self._active.pop()
            seq.future.set_result(GenOutput(seq.out_ids, seq.logprobs, seq.versions, reason, len(seq.prompt)))


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple
