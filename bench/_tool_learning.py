"""The calculator example trained with the user's tool and without (`bench/learning.py tool_learning`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import _common

from relayrl.common.files import read_jsonl

# What the run without the tool changes: one turn, no tool, the worked examples answered directly.
NO_TOOL = ["agent.kind=single_turn", "agent.kwargs={}", "data.train.kwargs.shots=answer",
           "data.eval.kwargs.shots=answer", "run.name=calculator_no_tools"]
TOOL_SIDES = {"tool": [], "no_tool": NO_TOOL}
STEP_KEYS = {"pass_rate": "rollout/pass_rate", "reward": "rollout/reward_mean", "tool_calls": "rollout/tool_calls_mean",
             "tool_errors": "rollout/tool_errors_mean", "turns": "rollout/turns_mean",
             "response_len": "rollout/response_len_mean", "step_s": "time/step_s", "rollout_s": "time/rollout_s",
             "train_s": "time/train_s"}
TOOL_EVAL_KEYS = {"pass@1": "eval/pass@1", "tool_calls": "eval/tool_calls_mean", "tool_errors": "eval/tool_errors_mean",
             "turns": "eval/turns_mean", "samples": "eval/samples", "eval_s": "time/eval_s"}


def tool_args(argv: list[str]) -> argparse.Namespace:
    p = _common.parser("tool_learning", tool_learning.__doc__)
    p.add_argument("--config", default="examples/calculator_tools.yaml")
    p.add_argument("--sides", default="tool,no_tool", help="which runs, in order (tool, no_tool)")
    p.add_argument("--out", help="result file (default bench/results/tool_learning.json; with overrides: none)")
    p.add_argument("--png", help="curve image (default docs/img/tool_learning.png; with overrides: none)")
    p.add_argument("overrides", nargs="*", help="config overrides for both runs, e.g. run.steps=2")
    return p.parse_args(argv)


def run_side(config: str, overrides: list[str], out_dir: str) -> dict:
    """One `relayrl train` in a subprocess: its wall time, the sampled peak RSS of it and its judge workers, and
    its run folder."""
    r = _common.train_run(config, overrides, out_dir, {**os.environ, "HF_HUB_OFFLINE": "1"})
    return {"command": r["command"], "wall_s": round(r["wall_s"], 1), "wall_min": round(r["wall_s"] / 60, 2),
            "sampled_trainer_peak_rss_gb": round(r["peaks"]["trainer"] / 1e9, 3),
            "sampled_tree_peak_rss_gb": round(r["peaks"]["tree"] / 1e9, 3), "run_dir": r["run_dir"],
            "precision": next((line for line in r["output"].splitlines() if line.startswith("precision:")), "")}


def curves(run_dir: Path) -> dict:
    """Per-step and per-evaluation records from a run's metrics.jsonl (keys a run does not log are left out: the
    run without the tool has no tool_calls)."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    steps = [{"step": r["step"], **{k: round(r[m], 4) for k, m in STEP_KEYS.items() if m in r}}
             for r in rows if "train/loss" in r]
    evals = [{"step": r["step"], **{k: round(r[m], 4) for k, m in TOOL_EVAL_KEYS.items() if m in r}}
             for r in rows if "eval/pass@1" in r]
    peak = max((r["mem/peak_rss_gb"] for r in rows if "mem/peak_rss_gb" in r), default=None)
    return {"steps": steps, "evals": evals, "trainer_peak_rss_gb": None if peak is None else round(peak, 3)}


def summary(side: dict) -> dict:
    """First and last few steps' means: what the table in docs/benchmarks.md quotes."""
    steps, evals = side["steps"], side["evals"]

    def mean(xs: list[dict], key: str) -> float | None:
        vals = [x[key] for x in xs if key in x]
        return round(sum(vals) / len(vals), 4) if vals else None

    head, tail = steps[:5], steps[-5:]
    out = {f"{k}_first5": mean(head, k) for k in ("pass_rate", "tool_calls", "turns")}
    out |= {f"{k}_last5": mean(tail, k) for k in ("pass_rate", "tool_calls", "turns")}
    if evals:
        n = int(evals[0].get("samples", 1))
        out |= {"eval_before": evals[0]["pass@1"], "eval_after": evals[-1]["pass@1"],
                "eval_stderr_before": round(_common.std_err(evals[0]["pass@1"], n), 4),
                "eval_stderr_after": round(_common.std_err(evals[-1]["pass@1"], n), 4)}
    return out


def plot(result: dict, out: Path) -> Path:
    """Three panels: success per step (training pass rate, held-out pass@1 as markers), tool calls per episode,
    turns per episode; one line per side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_p, ax_c, ax_t) = plt.subplots(1, 3, figsize=(14, 4))
    for i, (name, side) in enumerate(result["sides"].items()):
        color = f"C{i}"
        label = {"tool": "with the tool", "no_tool": "without"}.get(name, name)
        xs = [s["step"] for s in side["steps"]]
        ax_p.plot(xs, [s.get("pass_rate", 0.0) for s in side["steps"]], label=f"{label}: train pass rate", alpha=0.5,
                  color=color)
        ev = side["evals"]
        ax_p.plot([e["step"] for e in ev], [e["pass@1"] for e in ev], "o-", linewidth=2, color=color,
                  label=f"{label}: held-out pass@1")
        ax_c.plot(xs, [s.get("tool_calls", 0.0) for s in side["steps"]], label=label, color=color)
        ax_t.plot(xs, [s.get("turns", 1.0) for s in side["steps"]], label=label, color=color)
    ax_p.set(xlabel="step", ylabel="success", title="success (pass rate)", ylim=(0, 1))
    ax_c.set(xlabel="step", ylabel="calls per episode", title="tool calls per episode")
    ax_t.set(xlabel="step", ylabel="turns per episode", title="turns per episode")
    for ax in (ax_p, ax_c, ax_t):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def tool_learning(argv: list[str]) -> None:
    """Does learning to use your own tool pay? The calculator example trained with the tool and without, per step.

    Runs `relayrl train --config examples/calculator_tools.yaml` twice as a user would, one after the other (never at
    once: they would share the cores and both timings would be wrong): once as shipped (ToolAgent with the user's
    `calculate` function, the worked examples showing calls) and once without the tool (the single-turn agent, the
    same questions with the same worked examples answered directly). Each run's metrics.jsonl gives, per step,
    success (the rollouts' pass rate; held-out pass@1 at the evaluations), tool calls per episode
    (`rollout/tool_calls_mean`, counted by ToolAgent for each sample), tool errors and turns per episode.

    Writes bench/results/tool_learning.json (with the machine, the load before each run, wall time and peak memory of
    each run) and docs/img/tool_learning.png (the curves). Overrides after the options go to both runs and make it a
    check that is not recorded unless --out is given.

        .venv/bin/python bench/learning.py tool_learning                    # the recorded comparison (~16 min, 2 cores)
        .venv/bin/python bench/learning.py tool_learning run.steps=2 eval.size=8  # a quick check (not recorded)
    """
    a = tool_args(argv)
    record = not a.overrides
    result = {**_common.result_header("tool_learning"), "config": a.config, "overrides": a.overrides,
              "no_tool_overrides": NO_TOOL, "sides": {}}
    with tempfile.TemporaryDirectory(prefix="bench_tool_learning_") as tmp:
        for name in a.sides.split(","):
            load = _common.load_before_run()
            out_dir = Path(tmp) / name
            out_dir.mkdir()
            run = run_side(a.config, [*TOOL_SIDES[name], *a.overrides], str(out_dir))
            side = {"load_before": load, **{k: v for k, v in run.items() if k != "run_dir"}, **curves(run["run_dir"])}
            side["summary"] = summary(side)
            result["sides"][name] = side
            print(f"{name}: {json.dumps(side['summary'])} in {run['wall_min']} min", file=sys.stderr)
    png = a.png or ("docs/img/tool_learning.png" if record else None)
    if png:
        result["plot"] = str(plot(result, _common.REPO / png))
    print(json.dumps({k: v["summary"] for k, v in result["sides"].items()}, indent=2))
    out = a.out or ("bench/results/tool_learning.json" if record else None)
    if out:
        _common.write_json(_common.REPO / out, result)
