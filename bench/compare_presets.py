#!/usr/bin/env python
"""Compare algorithm presets on one task: held-out pass@1 before/after, wall-clock, and all curves in one plot.

    .venv/bin/python bench/compare_presets.py --steps 30                 # every preset, examples/arithmetic_grpo.yaml
    .venv/bin/python bench/compare_presets.py --presets grpo,ppo -- train.lr=5e-6
    .venv/bin/python bench/compare_presets.py --quick                    # smoke run on the tiny random model

Each preset runs the real CLI (`relayrl train --config CONFIG algo.preset=P ...`) in its own subprocess,
one after another (running them side by side would make them compete for the cores and skew wall-clock).
Every run gets the same seed, data, prompts per step and eval set, so the presets see the same prompts in
the same order. Writes bench/results/compare_presets.json (per preset: pass_before, pass_after, minutes,
median step seconds; ratios: wall-clock and pass_after relative to grpo) and docs/img/compare_presets.png.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import _common

from relayrl.common.utils import read_jsonl
from relayrl.config.presets import PRESETS
from relayrl.tracking.plot import plot_run

QUICK = ["model.autocast_bf16=false", "engine.dtype=float32", "data.batch_size=2", "data.group_size=4",
         "data.train.size=8", "sampling.max_new_tokens=12", "eval.size=2", "eval.n=1", "eval.every=0",
         "run.tensorboard=false", "run.save_final=false", "run.log_trajectories=false", "run.print_samples=0",
         "judge.workers=1",
         # a random model never earns the math reward; the tests' parity reward gives mixed groups (which
         # DAPO's dynamic sampling needs) from tests/rewards_for_tests.py
         "judge.reward_fn=rewards_for_tests:parity_reward", "judge.kwargs={}"]


def run_preset(preset: str, args: argparse.Namespace, extra: list[str]) -> dict:
    """One `relayrl train` subprocess; returns its summary (or the error) from the run's metrics.jsonl."""
    cmd = [sys.executable, "-m", "relayrl.cli", "train", "--config", args.config, f"algo.preset={preset}",
           f"run.steps={args.steps}", f"run.seed={args.seed}", f"run.name=compare_{preset}",
           f"run.output_dir={args.output_dir}", *extra]
    t0 = time.perf_counter()
    env = dict(os.environ)
    if args.quick:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_common.REPO / "tests"), env.get("PYTHONPATH")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    minutes = (time.perf_counter() - t0) / 60
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-4000:])
        return {"error": f"exit code {proc.returncode}", "minutes": minutes}
    run_dir = Path(re.search(r"run folder: (\S+)", proc.stdout).group(1))
    rows = read_jsonl(run_dir / "metrics.jsonl")
    evals = [r for r in rows if "eval/pass@1" in r]
    steps = [r for r in rows if "train/loss" in r]
    return {"pass_before": evals[0]["eval/pass@1"] if len(evals) > 1 else None,
            "pass_after": evals[-1]["eval/pass@1"] if evals else None,
            "eval_curve": [{"step": r["step"], "pass@1": r["eval/pass@1"]} for r in evals],
            "train_reward_last": steps[-1]["rollout/reward_mean"] if steps else None,
            "minutes": minutes, "steps": len(steps),
            "step_s_median": sorted(r["time/step_s"] for r in steps)[len(steps) // 2] if steps else None,
            "run_dir": str(run_dir)}


def ratios(results: dict[str, dict]) -> dict[str, float]:
    """Wall-clock and pass_after of each preset relative to grpo (measured in this same invocation)."""
    base = results.get("grpo", {})
    out = {}
    for name, r in results.items():
        if name == "grpo" or "error" in r or "error" in base or not base:
            continue
        out[f"{name}_vs_grpo_minutes"] = r["minutes"] / base["minutes"]
        if r.get("pass_after") is not None and base.get("pass_after"):
            out[f"{name}_vs_grpo_pass_after"] = r["pass_after"] / base["pass_after"]
    return out


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default=",".join(PRESETS), help="comma-separated preset names")
    p.add_argument("--config", default="examples/arithmetic_grpo.yaml")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="/tmp/relayrl_compare_presets", help="run.output_dir of the runs")
    p.add_argument("--out", default=None, help="result JSON (default bench/results/compare_presets.json)")
    p.add_argument("--plot", default=None, help="curves PNG (default docs/img/compare_presets.png)")
    p.add_argument("--quick", action="store_true", help="tiny random model, 2 steps, tiny sizes (a smoke test)")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="more `relayrl train` overrides after --")
    args = p.parse_args()
    extra = [x for x in args.train_args if x != "--"]
    unknown = [x for x in args.presets.split(",") if x not in PRESETS]
    if unknown:
        p.error(f"--presets: unknown {unknown}; known: {', '.join(PRESETS)}")
    if args.quick:
        from relayrl.models import tiny_model

        args.steps = min(args.steps, 2)
        extra = [f"model.path={tiny_model('qwen2')}", *QUICK, *extra]
        args.out = args.out or "/tmp/compare_presets_quick.json"  # a smoke run never replaces the recorded result
        args.plot = args.plot or "/tmp/compare_presets_quick.png"
    args.out = args.out or str(_common.REPO / "bench" / "results" / "compare_presets.json")
    args.plot = args.plot or str(_common.REPO / "docs" / "img" / "compare_presets.png")
    return args, extra


def main() -> None:
    args, extra = parse_args()
    results = {}
    for preset in args.presets.split(","):
        print(f"== {preset}", flush=True)
        results[preset] = run_preset(preset, args, extra)
        print({k: v for k, v in results[preset].items() if k != "eval_curve"}, flush=True)
    done = {k: r for k, r in results.items() if "error" not in r}
    png = plot_run([r["run_dir"] for r in done.values()], args.plot, labels=list(done)) if done else None
    result = _common.result_header("compare_presets") | {
        "config": args.config, "steps": args.steps, "overrides": extra, "metrics": results,
        "ratios": ratios(results), "plot": str(png) if png else None}
    _common.write_json(args.out, result)
    print(f"wrote {args.out} and {png}")
    if len(done) < len(results):
        sys.exit(f"failed presets: {sorted(set(results) - set(done))}")


if __name__ == "__main__":
    main()
