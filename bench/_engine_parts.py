"""The engine looked into (`bench/engine.py engine_step_parts|decode_profile|kv_dtype_parity|admission_occupancy`):
where a decode step's time goes, a bare decode forward profiled, what a bf16 KV cache does to logprobs, and how many
rows async admission keeps decoding. Each function named after its command is that command."""

from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import io
import json
import pstats
import random
import statistics
import time
from pathlib import Path

import _common

QUESTIONS = ["What is 7 * 8?", "What is 9 - 4? Put your final answer within \\boxed{}.",
             "Explain why the sky is blue in two sentences.", "What is 12 + 30?"]


# ---- engine_step_parts -----------------------------------------------------------------------------------------
def step_parts_args(argv: list[str]) -> argparse.Namespace:
    p = _common.parser("engine_step_parts", engine_step_parts.__doc__)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=150)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--kv-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="the engine's KV cache dtype (engine.kv_dtype; auto: the engine's)")
    p.add_argument("--no-bare", action="store_true", help="skip the bare decode forward beside the engine")
    p.add_argument("--no-cuda-graphs", action="store_true", help="a GPU engine decodes eagerly (cuda_graphs=False)")
    p.add_argument("--profile", action="store_true", help="also run the workload under torch.profiler and print the "
                   "top ops by self CPU and self device time")
    p.add_argument("--out", default=None, help="result file (default: print only)")
    p.add_argument("--quick", action="store_true", help="tiny model, 4 prompts x 4, 32 tokens")
    a = p.parse_args(argv)
    if a.quick:
        from relayrl.models import tiny_model

        a.model, a.prompts, a.group, a.prompt_len, a.max_new_tokens = str(tiny_model("qwen2")), 4, 4, 20, 32
    return a


def timed(engine, name: str, totals: dict, counts: dict) -> None:
    """Replace engine.<name> by a wrapper adding its synchronised wall time to totals[name]."""
    inner = getattr(engine, name)

    @functools.wraps(inner)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            _common.synchronize(engine.device)
            totals[name] += time.perf_counter() - t0
            counts[name] += 1

    setattr(engine, name, wrapper)


def bare_decode(model, batch: int, context: int, vocab: int):
    """Prefill random `batch` x `context` prompts with transformers' own DynamicCache (no relayrl code, no masks)
    and return a function that runs one decode forward on that cache (the context grows by one per call)."""
    import torch

    ids = torch.randint(0, vocab, (batch, context), device=next(model.parameters()).device)
    with torch.inference_mode():
        cache = model(input_ids=ids, use_cache=True).cache

    def step() -> None:
        with torch.inference_mode():
            model(input_ids=ids[:, -1:], cache=cache, use_cache=True)

    return step


def times_ms(step, device, reps: int) -> list[float]:
    """Wall ms of each of `reps` calls of step(), the device synchronised around each."""
    times = []
    for _ in range(reps):
        _common.synchronize(device)
        t0 = time.perf_counter()
        step()
        _common.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def bare_decode_ms(model, batch: int, context: int, vocab: int, reps: int = 5) -> float:
    """Median ms of one bare decode forward (`bare_decode`) at `batch` x `context`: the model's own cost."""
    return statistics.median(times_ms(bare_decode(model, batch, context, vocab), model.device, reps))


def profile_ops(path: str, dtype: str, device: str, prompts: list, group: int, params, top: int = 20) -> dict:
    """The workload twice more on a fresh engine, its worker loop stepped in this thread (a profiler records the
    thread that runs it): under torch.profiler, the top ops by self CPU time and by self device time; under
    cProfile, the top Python functions by their own time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from relayrl.engine.local import LocalEngine

    engine = LocalEngine.from_pretrained(path, dtype=dtype, device=device, max_batch_size=len(prompts) * group)
    engine._ensure_thread = lambda: None  # the profiler records CPU ops of its own thread: step the engine here

    def run(requests: list[list[int]]) -> None:
        futures = [engine.submit(p, params) for p in requests]
        while engine._waiting or engine._active:  # the body of LocalEngine._run, minus its locks and waits
            engine._admit(engine._take_admissible())
            if engine._active:
                engine._decode_step()
        _common.synchronize(device)
        assert all(f.done() for f in futures)

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch.inference_mode():
        run(prompts[:1])  # warm-up
        with profile(activities=activities) as prof:
            run([p for p in prompts for _ in range(group)])
        py = cProfile.Profile()  # and the Python functions, whose own time the op profile cannot show
        py.runcall(run, [p for p in prompts for _ in range(group)])
    engine.close()
    events = prof.key_averages()
    stats = pstats.Stats(py).stats
    by_own = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    out = {"python_tottime": [{"function": f"{Path(f).name}:{line}({name})", "calls": st[1], "ms": st[2] * 1e3}
                              for (f, line, name), st in by_own]}
    for key in ("self_cpu_time_total", "self_device_time_total"):
        rows = sorted(events, key=lambda e: getattr(e, key, 0), reverse=True)[:top]
        out[key] = [{"op": e.key, "calls": e.count, "ms": getattr(e, key, 0) / 1e3} for e in rows]
    return out


def run_parts(a, engine, prompts: list, params) -> dict:
    """The batch generated with the engine's parts timed: wall and busy seconds, per-part totals and calls."""
    totals: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.defaultdict(int)
    for name in ("_admit", "_decode_step", "_forward_decode", "_sample_and_append", "_retire_finished"):
        timed(engine, name, totals, counts)
    # the worker resolves a request's future before it closes its step's busy time: reading the clocks between
    # steps keeps the warm-up's last step out and this batch's last step in, so busy <= wall always holds
    with engine._between_steps():
        busy0 = engine.stats["busy_s"]
        t0 = time.perf_counter()
    engine.generate([p for p in prompts for _ in range(a.group)], params)
    with engine._between_steps():
        wall = time.perf_counter() - t0
        busy = engine.stats["busy_s"] - busy0
    return {"wall": wall, "busy": busy, "totals": totals, "counts": counts}


def engine_step_parts(argv: list[str]) -> None:
    """Where LocalEngine's generation time goes, part by part, on any device: admission (prefills, slot copies), the
    decode forward, sampling, retiring finished sequences, and the rest of the worker loop.

    Each part is timed inside the engine's own worker thread by wrapping the engine's methods on this instance (the
    device is synchronised after each part, so a part's time includes its kernels; the engine reads every step's
    tokens back anyway, so this adds little). Beside it: one bare decode forward of the same model at the same batch
    and context length with a plain dynamic KV cache (transformers' own), the model's cost without relayrl's slot
    cache and masks.

    Workload: --prompts random prompts of --prompt-len tokens x --group samples each, --max-new-tokens tokens each
    (ignore_eos), temperature 1, all submitted at once (as `bench/engine.py rollout`'s local side does).

        .venv/bin/python bench/engine.py engine_step_parts --quick            # tiny model, CPU, seconds
        python3 bench/engine.py engine_step_parts --model DIR --device cuda \\
            --out bench/results/gpu_engine_step_parts.json
    """
    a = step_parts_args(argv)
    from relayrl.common.device import resolve_device
    from relayrl.common.hardware import resolve_dtype
    from relayrl.engine.base import SamplingParams
    from relayrl.engine.local import LocalEngine
    from relayrl.models import resolve_model_path

    path = resolve_model_path(a.model)
    device = str(resolve_device(a.device))
    dtype = resolve_dtype(a.dtype, device)[0]
    engine = LocalEngine.from_pretrained(path, dtype=dtype, device=device, max_batch_size=a.prompts * a.group,
                                         cuda_graphs=not a.no_cuda_graphs, kv_dtype=a.kv_dtype)
    vocab = engine.model.config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(a.prompt_len)] for _ in range(a.prompts)]
    params = SamplingParams(max_new_tokens=a.max_new_tokens, temperature=1.0, ignore_eos=True)
    engine.generate(prompts[:1], SamplingParams(max_new_tokens=4, temperature=1.0, ignore_eos=True))  # warm-up
    r = run_parts(a, engine, prompts, params)
    totals, counts, wall = r["totals"], r["counts"], r["wall"]
    kv_gb = engine.cache.nbytes() / 1e9  # what the batch grew it to (an idle engine keeps it until released)
    engine.close()
    steps = counts["_decode_step"]
    bare = (None if a.no_bare else  # its prefill of every row's full prompt is long at long contexts
            bare_decode_ms(engine.model, a.prompts * a.group, a.prompt_len + a.max_new_tokens // 2, vocab))
    per_step = {k: 1e3 * totals[k] / max(steps, 1) for k in ("_decode_step", "_forward_decode")}
    # sampling and retiring also run once per admitted group inside _admit: their per-step share is an upper bound
    per_step["_sample_and_append_upper"] = 1e3 * totals["_sample_and_append"] / max(steps, 1)
    res = {**_common.result_header("engine_step_parts"),
           "workload": {"model": path, "device": device, "dtype": dtype, "prompts": a.prompts, "group": a.group,
                        "prompt_len": a.prompt_len, "max_new_tokens": a.max_new_tokens,
                        "cuda_graphs": engine.cuda_graphs, "kv_dtype": str(engine.cache.dtype).removeprefix("torch.")},
           "kv_cache_gb": kv_gb,
           "wall_s": wall, "worker_busy_s": r["busy"], "decode_steps": steps,
           "parts_s": {k.lstrip("_"): v for k, v in totals.items()},
           "calls": {k.lstrip("_"): v for k, v in counts.items()},
           "per_decode_step_ms": {k.lstrip("_"): v for k, v in per_step.items()},
           "bare_decode_forward_ms": bare, "bare_context": a.prompt_len + a.max_new_tokens // 2,
           "tokens_per_s": a.prompts * a.group * a.max_new_tokens / wall}
    if a.profile:
        res["profile"] = profile_ops(path, dtype, device, prompts, a.group, params)
    print(json.dumps(res, indent=2))
    if a.out:
        _common.write_json(a.out, res)


# ---- decode_profile --------------------------------------------------------------------------------------------
def print_profile(step, dev: str) -> None:
    """One step under torch.profiler (top ops by self CPU and device time), then under cProfile."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev != "cpu" else [])
    with profile(activities=acts) as prof:
        step()
        _common.synchronize(dev)
    ev = prof.key_averages()
    print("total self cpu ms", round(sum(e.self_cpu_time_total for e in ev) / 1e3, 2),
          "self device ms", round(sum(getattr(e, "self_device_time_total", 0) for e in ev) / 1e3, 2))
    for key in ("self_cpu_time_total", "self_device_time_total"):
        print("--", key)
        for e in sorted(ev, key=lambda e: getattr(e, key, 0), reverse=True)[:10]:
            print(f"   {e.key[:60]:60s} calls {e.count:5d} cpu {e.self_cpu_time_total / 1e3:8.2f} "
                  f"dev {getattr(e, 'self_device_time_total', 0) / 1e3:8.2f}")
    pr = cProfile.Profile()
    pr.enable()
    step()
    _common.synchronize(dev)
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(12)
    print(s.getvalue()[-2500:])


def decode_profile(argv: list[str]) -> None:
    """One bare decode forward of a model (transformers' own dynamic KV cache, no relayrl code in the forward) at
    --batch rows (32) and a --context-token context (278), timed 10 times and profiled once: which ops cost CPU
    time and which cost device time.

    Why it exists: on a GPU, a small model's decode step is bound by the host, not the device, and this shows which
    op holds the host. On the H200 it found SDPA's cuDNN backend spending 2 ms of CPU per call (a new execution plan
    for each context length) against 5.5 ms of GPU time for the whole step (docs/benchmarks.md, "On a GPU");
    relayrl.common.device.avoid_cudnn_attention is the fix. --cudnn keeps the cuDNN backend, to compare.

        python3 bench/engine.py decode_profile MODEL_DIR cuda      # e.g. a `bench/train.py random_model` folder
        .venv/bin/python bench/engine.py decode_profile MODEL_DIR cpu --batch 8 --context 64
    """
    p = _common.parser("decode_profile", decode_profile.__doc__)
    p.add_argument("model")
    p.add_argument("device")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=278)
    p.add_argument("--cudnn", action="store_true", help="leave SDPA's cuDNN backend on (torch's own choice)")
    a = p.parse_args(argv)
    import torch

    from relayrl.common.device import avoid_cudnn_attention
    from relayrl.models import load_model

    dev = a.device
    m = load_model(a.model, dtype="bfloat16", device=dev)
    if not a.cudnn:
        avoid_cudnn_attention(torch.device(dev))
    print("param devices", {str(p.device) for p in m.parameters()}, "buffers", {str(b.device) for b in m.buffers()},
          "attn", m.config._attn_implementation, "threads", torch.get_num_threads(),
          "cudnn sdpa", torch.backends.cuda.cudnn_sdp_enabled())
    step = bare_decode(m, a.batch, a.context, min(1000, m.config.vocab_size))
    print("decode ms", [round(x, 1) for x in times_ms(step, dev, 10)])  # the context grows by one per call
    print_profile(step, dev)


# ---- kv_dtype_parity -------------------------------------------------------------------------------------------
def parity_side(model, tok, path: str, prompts: list, trainer, kv: str, a) -> dict:
    """One KV cache dtype: the engine samples, the trainer scores the same tokens, the gaps summarised."""
    import torch

    from relayrl.engine.base import SamplingParams
    from relayrl.engine.local import LocalEngine
    from relayrl.models import eos_token_ids
    from relayrl.sample import Sample
    from relayrl.trainer.packer import Packer

    engine = LocalEngine(model, eos_token_ids=eos_token_ids(tok, path), max_batch_size=16, kv_dtype=kv)
    samples = []
    for g, prompt in enumerate(prompts):
        params = SamplingParams(max_new_tokens=a.max_new_tokens, temperature=1.0, seed=g)
        for out in engine.generate([prompt] * a.samples, params):
            s = Sample(prompt_ids=prompt, group_id=str(g))
            s.append_generated(out.output_ids, out.logprobs, out.versions, out.finish_reason)
            samples.append(s)
    engine.close()
    batch = Packer(4096, pad_id=tok.pad_token_id, share_prompt=True).pack(samples)
    for mb in batch.micro_batches:
        batch.scatter("logp", mb, trainer.forward_logprobs(mb))
    gap = torch.cat([torch.tensor(s.logprobs) - lp for s, lp in zip(samples, batch.per_token["logp"])])
    return {"tokens": gap.numel(), "max_abs": gap.abs().max().item(),
            "mean_abs": gap.abs().mean().item(), "p99_abs": gap.abs().quantile(0.99).item(),
            "ratio_min": gap.exp().min().item(), "ratio_max": gap.exp().max().item()}


def kv_dtype_parity(argv: list[str]) -> None:
    """How far a bf16 KV cache (engine.kv_dtype=bfloat16) moves an fp32 engine's logprobs from the trainer's, on the
    real model: both engines sample from the same chat prompts, the trainer scores the same tokens, and the per-token
    gaps and importance ratios (exp(engine - trainer)) are summarised.

    Why: the engine's logprobs are the old-policy logprobs of relayrl's losses (and the behaviour logprobs of a
    decoupled one), so a cache that rounds keys and values shows up in every importance ratio; this says by how much.

        HF_HUB_OFFLINE=1 .venv/bin/python bench/engine.py kv_dtype_parity --out bench/results/kv_dtype_parity.json
    """
    p = _common.parser("kv_dtype_parity", kv_dtype_parity.__doc__)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--samples", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    from relayrl.models import load_model, load_tokenizer, resolve_model_path
    from relayrl.trainer.engine import TrainEngine

    path = resolve_model_path(a.model)
    tok = load_tokenizer(path)
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True))["input_ids"] for q in QUESTIONS]
    model = load_model(path, dtype="float32")
    trainer = TrainEngine(model, temperature=1.0)
    res = {**_common.result_header("kv_dtype_parity"), "workload": {
        "model": path, "prompts": len(prompts), "samples": a.samples, "max_new_tokens": a.max_new_tokens}, "sides": {}}
    for kv in ("auto", "bfloat16"):
        res["sides"][kv] = parity_side(model, tok, path, prompts, trainer, kv, a)
    print(json.dumps(res, indent=2))
    if a.out:
        _common.write_json(a.out, res)


# ---- admission_occupancy ---------------------------------------------------------------------------------------
def draw(rng: random.Random, cap: int, cap_frac: float, low: int, high: int) -> int:
    return cap if rng.random() < cap_frac else rng.randint(low, high)


def producer(groups: int, group_size: int, steps: int, lengths) -> dict:
    """`groups` always running, each replaced by a fresh one the step its slowest sample ends."""
    running = [[lengths() for _ in range(group_size)] for _ in range(groups)]
    ages = [0] * groups
    live = finished = 0
    for _ in range(steps):
        for i, group in enumerate(running):
            ages[i] += 1
            live += sum(length >= ages[i] for length in group)
            if ages[i] >= max(group):
                finished += group_size
                running[i], ages[i] = [lengths() for _ in range(group_size)], 0
    return {"live_rows": live / steps, "samples_per_decode_step": finished / steps}


def sync(groups: int, group_size: int, batches: int, lengths) -> dict:
    """Batches of `groups` groups that start together and end with their slowest sample."""
    tokens = steps = 0
    for _ in range(batches):
        batch = [lengths() for _ in range(groups * group_size)]
        tokens, steps = tokens + sum(batch), steps + max(batch)
    return {"live_rows": tokens / steps, "samples_per_decode_step": groups * group_size * batches / steps}


def admission_occupancy(argv: list[str]) -> None:
    """How many rows an async producer's engine actually decodes when it admits whole GRPO groups (no model).

    Why: with scheduler.max_staleness=2 and 8 prompts x 8 samples a step, the admission rule lets 24 groups (192 rows)
    run at once, but a group counts as running until its slowest sample ends. With long-tailed lengths most of a
    running group's rows are already done. This simulates the rule in decode steps: every live row advances one token
    per step, a finished group is replaced at once (a producer that is never held), and a sync batch of the same
    groups starts together and ends with its slowest sample. It prints the mean live rows and samples finished per
    decode step of each, so an async run's `engine/rows_per_step` can be read against what admission allows.

    Lengths (default): SmolLM2-135M-Instruct's first steps on the arithmetic task under a 512-token cap, roughly: 9%
    at the cap, the rest uniform in 20-100 tokens (mean ~100 overall).

        .venv/bin/python bench/engine.py admission_occupancy --out bench/results/admission_occupancy.json
    """
    p = _common.parser("admission_occupancy", admission_occupancy.__doc__)
    p.add_argument("--batch", type=int, default=8, help="prompt groups per training step")
    p.add_argument("--group", type=int, default=8, help="samples per group")
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 2, 5])
    p.add_argument("--cap", type=int, default=512)
    p.add_argument("--cap-frac", type=float, default=0.09)
    p.add_argument("--low", type=int, default=20)
    p.add_argument("--high", type=int, default=100)
    p.add_argument("--steps", type=int, default=20000, help="simulated decode steps per producer setting")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    rng = random.Random(a.seed)

    def lengths() -> int:
        return draw(rng, a.cap, a.cap_frac, a.low, a.high)

    result = {"workload": vars(a), "sync": sync(a.batch, a.group, max(1, a.steps // a.cap), lengths),
              "producer": {str(s): {"groups_running": (s + 1) * a.batch,
                                    **producer((s + 1) * a.batch, a.group, a.steps, lengths)}
                           for s in a.staleness}}
    for r in result["producer"].values():
        r["vs_sync"] = r["samples_per_decode_step"] / result["sync"]["samples_per_decode_step"]
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
