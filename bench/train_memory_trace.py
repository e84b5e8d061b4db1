#!/usr/bin/env python
"""Resident memory through the README job's training steps, micro-batch by micro-batch, with and without the
trainer's heap trims: what the trims buy and what they cost.

Each side is a child process that builds the run from examples/arithmetic_grpo.yaml and steps it as
relayrl.run.loop.train_colocated does (rollout, release the engine's memory, fit, weight sync). Around every
phase it reads VmRSS and the high-water mark since the previous mark (VmHWM, reset by writing 5 to
/proc/self/clear_refs), so each row says how high memory went inside that phase. The "no_trim" side replaces
relayrl.trainer.engine.trim_memory (called after each micro-batch's forward and backward) with a no-op; every
other part is the shipped code. Sides alternate round by round; same data, seeds and batches on both.

    .venv/bin/python bench/train_memory_trace.py                 # 3 steps, 2 rounds of both sides
    .venv/bin/python bench/train_memory_trace.py --rounds 1 --steps 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import _common

SIDES = ("trim", "no_trim")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="examples/arithmetic_grpo.yaml")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="alternating runs of each side")
    p.add_argument("--out", default="bench/results/train_memory_trace.json")
    p.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _status_gb(key: str) -> float:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key))
    return int(line.split()[1]) * 1024 / 1e9


class Trace:
    """Rows of (phase, RSS now, peak since the previous row)."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def mark(self, phase: str) -> None:
        self.rows.append({"phase": phase, "rss_gb": round(_status_gb("VmRSS"), 3),
                          "peak_since_last_gb": round(_status_gb("VmHWM"), 3)})
        Path("/proc/self/clear_refs").write_text("5")  # restart the high-water mark from the current RSS


def run_side(a) -> dict:
    import relayrl.run.loop  # noqa: F401 - everything the CLI imports
    import relayrl.trainer.engine as engine_module
    from relayrl.common.utils import trim_memory, tune_allocator
    from relayrl.config.schema import load_run_config
    from relayrl.run.build import build

    tune_allocator()
    if a.side == "no_trim":
        engine_module.trim_memory = lambda: None
    trace = Trace()
    fit_s = []
    with tempfile.TemporaryDirectory(prefix="bench_trace_") as tmp:
        cfg = load_run_config(a.config, [f"run.output_dir={tmp}", "run.tensorboard=false", "eval.at_start=false",
                                         "eval.at_end=false", f"run.steps={a.steps}", "run.print_samples=0"])
        c = build(cfg)
        engine = c.train_ctl.engine
        plain_micro = engine._micro_step

        def micro_step(mb, *rest):
            out = plain_micro(mb, *rest)
            trace.mark(f"micro-batch {mb.num_tokens} tokens")
            return out

        engine._micro_step = micro_step
        trace.mark("built")
        try:
            for step in range(1, a.steps + 1):
                batch, _ = c.rollouts.next_batch(c.train_ctl.version)
                trace.mark(f"step {step} rollout")
                c.rollouts.release_memory()
                t0 = time.perf_counter()
                c.train_ctl.fit(batch)
                fit_s.append(time.perf_counter() - t0)
                trace.mark(f"step {step} fit end")
                c.rollouts.push_weights(c.train_ctl)
                trim_memory()
                trace.mark(f"step {step} weight sync")
        finally:
            c.close()
    train_rows = [r for r in trace.rows if r["phase"].startswith("micro-batch")]
    return {"side": a.side, "fit_s": [round(t, 2) for t in fit_s],
            "train_peak_gb": max(r["peak_since_last_gb"] for r in train_rows), "trace": trace.rows}


def child(side: str, a) -> dict:
    return _common.run_child(__file__, ["--side", side, "--config", a.config, "--steps", str(a.steps)],
                             f"side {side}")


def main() -> None:
    a = parse_args()
    if a.side:
        _common.write_json(a.result_file, run_side(a))
        return
    load = _common.load_before_run()
    runs = [child(side, a) for _ in range(a.rounds) for side in SIDES]
    summary = {}
    for side in SIDES:
        mine = [r for r in runs if r["side"] == side]
        summary[side] = {"train_peak_gb": [r["train_peak_gb"] for r in mine],
                         "fit_s_total": [round(sum(r["fit_s"]), 2) for r in mine]}
    ratio = statistics.median(summary["trim"]["fit_s_total"]) / statistics.median(summary["no_trim"]["fit_s_total"])
    result = _common.result_header("train_memory_trace") | {
        "load_before": load, "config": a.config, "steps": a.steps, "rounds": a.rounds, "summary": summary,
        "ratios": {"trim_vs_no_trim_fit_time": round(ratio, 3),
                   "trim_vs_no_trim_train_peak": round(statistics.median(summary["trim"]["train_peak_gb"])
                                                       / statistics.median(summary["no_trim"]["train_peak_gb"]), 3)},
        "runs": runs}
    _common.write_json(a.out, result)
    print(json.dumps({"summary": summary, "ratios": result["ratios"]}, indent=1))


if __name__ == "__main__":
    main()
