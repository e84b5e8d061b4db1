#!/usr/bin/env python
"""Asynchronous vs synchronous RL: wall-clock for the same number of trained samples, and the reward curves.

Workload: SmolLM2-135M-Instruct on 2-term arithmetic at temperature 1.0 with a 512-token cap. About one
sample in six loops until the cap, so response lengths are long-tailed: a synchronous step waits for its
slowest sample while the engine decodes a nearly empty batch; an asynchronous producer keeps the batch
full with the next prompts. Every variant uses the same config, seed, prompts and number of steps
(= trained samples); only `scheduler.*` differs. Runs go one after another in this process's children.

    .venv/bin/python bench/async_vs_sync.py                     # sync, async (colocated), async (separate)
    .venv/bin/python bench/async_vs_sync.py --steps 2 --quick   # smoke run on the tiny model
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common

from relayrl.common.utils import read_jsonl
from relayrl.tracking.plot import plot_run

VARIANTS = {
    "sync": [],
    "async": ["scheduler.mode=async", "scheduler.max_staleness=2", "scheduler.max_concurrency=16"],
    "async_separate": ["scheduler.mode=async", "scheduler.max_staleness=2", "scheduler.max_concurrency=16",
                       "scheduler.placement=separate", "scheduler.producer_threads=1", "run.threads=1"],
}


def run_variant(name: str, a: argparse.Namespace, out_dir: str) -> dict:
    over = [f"run.steps={a.steps}", f"sampling.max_new_tokens={a.max_new_tokens}", "eval.at_start=false",
            "eval.at_end=false", f"run.output_dir={out_dir}", f"run.name={name}", "run.save_final=false",
            "run.print_samples=0", f"run.seed={a.seed}", *VARIANTS[name], *a.override]
    if a.quick:
        from relayrl.models import tiny_model

        over += [f"model.path={tiny_model()}", "model.autocast_bf16=false", "engine.dtype=float32",
                 "data.batch_size=2", "data.group_size=2"]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "relayrl.cli", "train", "--config", a.config, *over],
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = [r for r in read_jsonl(Path(out_dir) / name / "metrics.jsonl") if "train/loss" in r]
    loop_s = sum(r["time/step_s"] for r in rows)
    return {"wall_s": wall, "train_loop_s": loop_s, "steps": len(rows),
            "trained_samples": sum(r["train/samples"] for r in rows),
            "step_s_median": statistics.median(r["time/step_s"] for r in rows),
            "step_s_all": [r["time/step_s"] for r in rows],  # the first async step includes the producer's start
            "reward_curve": [r["rollout/reward_mean"] for r in rows],
            "reward_mean": statistics.fmean(r["rollout/reward_mean"] for r in rows),
            "response_len_mean": statistics.fmean(r["rollout/response_len_mean"] for r in rows),
            "truncated_frac": statistics.fmean(r["rollout/truncated_frac"] for r in rows),
            "staleness_max": max((r.get("staleness/max", 0.0) for r in rows), default=0.0)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="examples/arithmetic_grpo.yaml")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--override", nargs="*", default=[], help="extra key=value overrides for every variant")
    p.add_argument("--quick", action="store_true", help="tiny model smoke run")
    p.add_argument("--out", default="bench/results/async_vs_sync.json")
    a = p.parse_args()
    names = [v for v in a.variants.split(",") if v]
    with tempfile.TemporaryDirectory(prefix="relayrl_async_bench_") as tmp:
        results = {n: run_variant(n, a, tmp) for n in names}
        png = None
        if not a.quick:
            png = plot_run([Path(tmp) / n for n in names], _common.REPO / "docs" / "img" / "async_vs_sync.png",
                           labels=names)
    sync_s = results["sync"]["train_loop_s"] if "sync" in results else None
    ratios = {f"{n}_vs_sync_speedup": sync_s / r["train_loop_s"] for n, r in results.items() if n != "sync" and sync_s}
    result = _common.result_header("async_vs_sync") | {
        "workload": {"config": a.config, "steps": a.steps, "max_new_tokens": a.max_new_tokens, "seed": a.seed},
        "metrics": results, "ratios": ratios, "plot": str(png.relative_to(_common.REPO)) if png else None}
    if not a.quick:  # a smoke run never replaces the recorded result
        _common.write_json(_common.REPO / a.out, result)
    print({k: round(v, 3) for k, v in ratios.items()})


if __name__ == "__main__":
    main()
