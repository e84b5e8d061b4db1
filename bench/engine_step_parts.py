#!/usr/bin/env python
"""Where LocalEngine's generation time goes, part by part, on any device: admission (prefills, slot copies), the
decode forward, sampling, retiring finished sequences, and the rest of the worker loop.

Each part is timed inside the engine's own worker thread by wrapping the engine's methods on this instance (the
device is synchronised after each part, so a part's time includes its kernels; the engine reads every step's
tokens back anyway, so this adds little). Beside it: one bare decode forward of the same model at the same batch and
context length with a plain dynamic KV cache (transformers' own), the model's cost without relayrl's slot cache
and masks.

Workload: --prompts random prompts of --prompt-len tokens x --group samples each, --max-new-tokens tokens each
(ignore_eos), temperature 1, all submitted at once (as bench/rollout.py's local side does).

    .venv/bin/python bench/engine_step_parts.py --quick            # tiny model, CPU, seconds
    python3 bench/engine_step_parts.py --model DIR --device cuda --out bench/results/gpu_engine_step_parts.json
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import json
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

import _common


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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


def main() -> None:
    a = parse_args()
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
           "wall_s": wall, "worker_busy_s": busy, "decode_steps": steps,
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


if __name__ == "__main__":
    sys.exit(main())
