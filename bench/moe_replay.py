#!/usr/bin/env python
"""Rollout routing replay on the tiny random Qwen3-MoE: `bench/moe_replay.py gap` (`gap --help` for its options).

What it measures: how far the trainer's logprobs of the engine's tokens are from the engine's own, with the engine's
experts replayed (algo.routing_replay) and with the trainer's router choosing, over the steps of a GRPO run
(`relayrl train` on examples/moe_replay.yaml, in a subprocess). The gap only exists where engine and trainer differ:
"bf16" runs a bf16 engine beside the fp32 trainer, "stale" an fp32 engine one policy version behind (async, staleness
1). Each step's metrics (relayrl.trainer.routing) are taken at the weights the step starts from. Random weights and
a parity reward (tests/rewards_for_tests.py): the runs train, they do not learn anything worth claiming.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from pathlib import Path

import _common

from relayrl.common.files import read_jsonl
from relayrl.models.tiny import build_tiny_model

KEYS = ("train/routing_agreement", "train/logprob_diff_engine_replay", "train/logprob_diff_engine_noreplay")
VARIANTS = {"bf16": ["engine.dtype=bfloat16"],
            "stale": ["engine.dtype=float32", "scheduler.mode=async", "scheduler.max_staleness=1"]}
COMMON = ["model.autocast_bf16=false", "data.batch_size=4", "data.group_size=4", "sampling.max_new_tokens=16",
          "judge.reward_fn=rewards_for_tests:parity_reward", "judge.kwargs={}", "judge.workers=1",
          "run.tensorboard=false", "run.save_final=false", "run.print_samples=0", "train.lr=1e-3"]


def gap(argv: list[str]) -> None:
    """The logprob gap without the replay over the gap with it, per variant, averaged over the steps after --skip."""
    p = _common.parser("gap", gap.__doc__)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--skip", type=int, default=2, help="first steps left out of the averages (weights still near init)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--out", default=str(_common.REPO / "bench" / "results" / "moe_replay.json"))
    args = p.parse_args(argv)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_common.REPO / "tests"), env.get("PYTHONPATH")]))
    result = {**_common.result_header("moe_replay"), "steps": args.steps, "skip": args.skip, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "tiny-moe", arch="qwen3_moe")
        for name in args.variants:
            out = Path(tmp) / name
            run = _common.train_run(str(_common.REPO / "examples" / "moe_replay.yaml"),
                                    [f"model.path={model}", f"run.steps={args.steps}", *COMMON, *VARIANTS[name]],
                                    str(out), env)
            rows = [r for r in read_jsonl(run["run_dir"] / "metrics.jsonl") if KEYS[0] in r]
            later = rows[args.skip:]
            mean = {k: statistics.fmean(r[k] for r in later) for k in KEYS}
            result["runs"][name] = {
                "overrides": VARIANTS[name], "wall_s": run["wall_s"],
                "per_step": [{"step": r["step"], **{k: r[k] for k in KEYS}} for r in rows],
                "mean": mean,
                "noreplay_over_replay": mean[KEYS[2]] / mean[KEYS[1]] if mean[KEYS[1]] else None}
            print(name, result["runs"][name]["mean"], "ratio", result["runs"][name]["noreplay_over_replay"])
    _common.write_json(args.out, result)
    print(args.out)


if __name__ == "__main__":
    _common.dispatch(__doc__, {"gap": gap})
