#!/usr/bin/env python
"""LocalEngine's prefill, one prompt per forward vs batched with the shared start once, side by side in one run.

Workloads from the README job (examples/arithmetic_grpo.yaml, its prompts, engine settings and sampling):
- eval: the held-out set as its evaluation runs it, 128 prompts x 2 samples, all submitted at once;
- rollout: one training step's batch, 8 prompts x 8 samples;
- prefill_only: the eval's 128 prompts with max_new_tokens=1, so the prefill alone is timed.
Each side is one setting of `engine.prefill_tokens` (0: one prompt per forward, the engine before batched prefill;
2048: the default) on one engine and one model, alternating round by round; same prompts and seeds on both sides.
Reports the median wall time per workload and side, the engine's prefilled tokens, and the ratio.

    .venv/bin/python bench/prefill.py                      # README job settings, this CPU
    .venv/bin/python bench/prefill.py --cpu avx2           # as on an AVX2-only CPU (bench/_common.AVX2_ENV)
    .venv/bin/python bench/prefill.py --quick              # smoke run on a tiny random model
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import _common

WORKLOADS = {"eval": (128, 2, None), "rollout": (8, 8, None), "prefill_only": (128, 1, 1)}  # prompts, n, max_new


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="examples/arithmetic_grpo.yaml")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sides", default="0,2048", help="engine.prefill_tokens values to compare")
    p.add_argument("--cpu", choices=["native", "avx2"], default="native")
    p.add_argument("--quick", action="store_true", help="tiny random model, 1 round, small workloads")
    p.add_argument("--out", default=None, help="default bench/results/prefill[_avx2].json")
    a = p.parse_args(argv)
    a.out = a.out or f"bench/results/prefill{'_avx2' if a.cpu == 'avx2' else ''}{'_quick' if a.quick else ''}.json"
    return a


def build(config: str, quick: bool):
    """The README job's engine (dtype auto, its decode kernel and LM head) and its eval prompts, as `relayrl train`
    builds them."""
    from relayrl.api import load_config
    from relayrl.common.hardware import resolve_dtype
    from relayrl.data import PromptBuilder, load_rows
    from relayrl.engine.local import LocalEngine
    from relayrl.models import eos_token_ids, load_model, load_tokenizer, tiny_model
    from relayrl.models.loading import resolve_model_path

    cfg = load_config(config)
    path = str(tiny_model("qwen2")) if quick else resolve_model_path(cfg.model.path)
    tok = load_tokenizer(path)
    dtype = resolve_dtype(cfg.engine.dtype, "cpu", cfg.model.autocast_bf16)[0]
    engine = LocalEngine(load_model(path, dtype=dtype), eos_token_ids=eos_token_ids(tok, path),
                         max_batch_size=cfg.engine.max_batch_size, attention=cfg.engine.attention, seed=0)
    prompt_fn = PromptBuilder(tok, cfg.data.prompt, cfg.data.eval)
    prompts = [prompt_fn(r) for r in load_rows(cfg.data.eval, "data.eval")[:128]]
    return cfg, engine, prompts, dtype


def run_workload(engine, prompts, n, max_new, temperature, side: int) -> dict:
    from relayrl.engine.base import SamplingParams

    engine.prefill_tokens = side
    before = dict(engine.stats)
    futures = [engine.submit(p, SamplingParams(max_new_tokens=max_new, temperature=temperature, seed=1000 * i + j))
               for i, p in enumerate(prompts) for j in range(n)]
    t0 = time.perf_counter()
    outs = [f.result() for f in futures]
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "generated_tokens": sum(len(o.output_ids) for o in outs),
            "prefill_tokens": engine.stats["prefill_tokens"] - before["prefill_tokens"],
            "prompt_tokens": sum(len(p) for p in prompts)}


def main(argv=None) -> None:
    a = parse_args(argv)
    if a.cpu == "avx2" and os.environ.get("ATEN_CPU_CAPABILITY") != "avx2":
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **_common.AVX2_ENV})
    import torch

    cfg, engine, prompts, dtype = build(a.config, a.quick)
    sides = [int(s) for s in a.sides.split(",")]
    rounds = 1 if a.quick else a.rounds
    runs: dict[str, dict[int, list[dict]]] = {w: {s: [] for s in sides} for w in WORKLOADS}
    with torch.inference_mode():
        run_workload(engine, prompts[:4], 2, 4, 1.0, sides[-1])  # warm-up: kernels, caches, the head choice
        for r in range(rounds):
            for w, (n_prompts, n, max_new) in WORKLOADS.items():  # noqa: B007 - max_new is set per workload
                for side in (sides if r % 2 == 0 else sides[::-1]):
                    size = min(n_prompts, 8) if a.quick else n_prompts
                    max_new = max_new or (8 if a.quick else cfg.sampling.max_new_tokens)
                    res = run_workload(engine, prompts[:size], n, max_new, cfg.sampling.temperature, side)
                    runs[w][side].append(res)
                    print(f"round {r} {w} prefill_tokens={side}: {res['wall_s']:.2f} s, "
                          f"{res['prefill_tokens']} tokens prefilled", flush=True)
    engine.close()
    summary = {}
    for w in WORKLOADS:
        med = {s: statistics.median(x["wall_s"] for x in runs[w][s]) for s in sides}
        summary[w] = {"median_wall_s": {str(s): round(med[s], 3) for s in sides},
                      "prefill_tokens": {str(s): runs[w][s][0]["prefill_tokens"] for s in sides},
                      "speedup": round(med[sides[0]] / med[sides[-1]], 3)}
    result = {**_common.result_header("prefill"), "command": " ".join([sys.executable, *sys.argv]),
              "config": a.config, "engine_dtype": str(dtype), "rounds": rounds, "sides": sides,
              "summary": summary, "runs": {w: {str(s): v for s, v in d.items()} for w, d in runs.items()}}
    _common.write_json(a.out, result)
    for w, s in summary.items():
        print(f"{w}: {s['median_wall_s']} -> {s['speedup']}x")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
