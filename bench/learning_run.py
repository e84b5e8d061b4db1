#!/usr/bin/env python
"""A recorded learning run: `relayrl train` on a config, held-out pass rate before and after, and the curve.

    .venv/bin/python bench/learning_run.py --name learning_arithmetic_grpo -- \
        --config examples/arithmetic_grpo.yaml run.steps=40 eval.every=10

Runs the real CLI in a subprocess, then reads the run's metrics.jsonl and writes
bench/results/NAME.json (pass_before, pass_after, their standard errors, minutes, the eval curve) and
docs/img/NAME.png (reward and pass-rate curves).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

import _common

from relayrl.common.utils import read_jsonl
from relayrl.tracking.plot import plot_run

EVAL_KEYS = ("eval/pass", "eval/maj", "eval/solved", "eval/recovered", "eval/retry", "eval/planted")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--name", required=True, help="result name (bench/results/NAME.json, docs/img/NAME.png)")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="arguments for `relayrl train` after --")
    a = p.parse_args()
    args = [x for x in a.train_args if x != "--"]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "relayrl.cli", "train", *args], capture_output=True, text=True)
    minutes = (time.perf_counter() - t0) / 60
    sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
    if proc.returncode != 0:
        sys.exit(f"relayrl train failed with code {proc.returncode}")
    run_dir = Path(re.search(r"run folder: (\S+)", proc.stdout).group(1))
    rows = read_jsonl(run_dir / "metrics.jsonl")
    evals = [r for r in rows if "eval/pass@1" in r]
    steps = [r for r in rows if "train/loss" in r]
    if len(evals) < 2:
        sys.exit("the run needs an eval at start and end (eval.at_start/at_end) to compare pass rates")
    n_eval = int(evals[0]["eval/samples"])
    before, after = evals[0]["eval/pass@1"], evals[-1]["eval/pass@1"]
    png = plot_run([run_dir], _common.REPO / "docs" / "img" / f"{a.name}.png", labels=[a.name])
    result = _common.result_header(a.name) | {
        "metrics": {"pass_before": before, "pass_after": after, "pass_before_stderr": _common.std_err(before, n_eval),
                    "pass_after_stderr": _common.std_err(after, n_eval), "eval_samples": n_eval,
                    "minutes": minutes, "steps": len(steps),
                    "step_s_median": sorted(r["time/step_s"] for r in steps)[len(steps) // 2],
                    "eval_curve": [{k: r[k] for k in r if k == "step" or k.startswith(EVAL_KEYS)} for r in evals],
                    "train_reward_first5": [r["rollout/reward_mean"] for r in steps[:5]],
                    "train_reward_last5": [r["rollout/reward_mean"] for r in steps[-5:]]},
        "ratios": {}, "run_dir": str(run_dir), "plot": str(png.relative_to(_common.REPO))}
    _common.write_json(_common.REPO / "bench" / "results" / f"{a.name}.json", result)
    print(result)


if __name__ == "__main__":
    main()
