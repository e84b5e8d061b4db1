#!/usr/bin/env python
"""Time and samples to a target held-out accuracy: relayrl sync, relayrl async and TRL's GRPOTrainer.

Every side trains the same model on the same prompts with the same group size, lr, generation length and temperature
(the run config, examples/arithmetic_grpo.yaml by default, read by all three), and is evaluated every --eval-every
steps on the same held-out set by relayrl's evaluator (pass@1 at T=1, eval.n samples per prompt). A side stops at
the first eval at or above --target, at the first eval past --budget-min of training, or at --max-steps.
Wall-clock excludes start-up and eval: it is the sum of the training steps' seconds (rollout + reward + train +
weight sync). Sides run one after another, each in its own subprocess.

    .venv/bin/python bench/time_to_accuracy.py            # full run (the example: SmolLM2, 8x8, 64 tokens; target 0.6)
    .venv/bin/python bench/time_to_accuracy.py --quick    # smoke run on the tiny random model (< 2 min)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common
import _tta_trl  # TRL itself loads only in the TRL side's subprocess
import torch
from _common import descendants

from relayrl.common.errors import InputError
from relayrl.common.files import read_jsonl
from relayrl.config.loader import ConfigError
from relayrl.config.schema import load_run_config
from relayrl.run.resolve import resolve

SIDES = ("sync", "async", "trl")
QUICK = {"eval_every": 1, "eval_size": 4, "max_steps": 2, "budget_min": 1.0, "threads": 1}
QUICK_OVERRIDES = ["model.autocast_bf16=false", "engine.dtype=float32", "model.gradient_checkpointing=false",
                   "data.batch_size=2", "data.group_size=2", "data.train.size=32", "sampling.max_new_tokens=8",
                   "eval.n=2"]
NOTES = {
    "wall_s_excl_eval": "sum of the training steps' seconds: rollout + reward + train + weight sync (relayrl: "
                        "time/step_s of metrics.jsonl; TRL: on_step_begin..on_step_end); start-up and eval excluded",
    "to_target": "taken at the first eval with pass@1 >= target: resolution is --eval-every steps",
    "stderr": "binomial standard error of pass@1 over the eval samples (prompts x eval.n)",
    "async_eval": "relayrl async: the producer keeps generating during an eval (at most max_staleness batches "
                  "ahead), so eval time is excluded but that generation is kept",
    "time_at_equal_steps": "*_time_at_equal_steps: the same ratio of training seconds at each eval step both sides "
                           "reached (step -> ratio), the steadier reading when the sides cross the target at "
                           "different evals",
    "bounds": "a ratio whose side did not reach the target within its budget is a bound (kind lower_bound / "
              "upper_bound, text in *_bound); null when neither side reached it",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="examples/arithmetic_grpo.yaml", help="the run config every side follows")
    p.add_argument("--model", default="smollm2", help="model folder or relayrl alias")
    p.add_argument("--target", type=float, default=0.6, help="held-out pass@1 to reach")
    p.add_argument("--eval-every", type=int, default=10, help="steps between evals")
    p.add_argument("--eval-size", type=int, default=128, help="held-out prompts per eval")
    p.add_argument("--budget-min", type=float, default=30.0, help="training minutes (excluding eval) per side")
    p.add_argument("--max-steps", type=int, default=200, help="steps per side at most")
    p.add_argument("--staleness", type=int, default=1, choices=(1, 2), help="async: scheduler.max_staleness")
    p.add_argument("--separate", action="store_true", help="async: scheduler.placement=separate")
    p.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated subset of {','.join(SIDES)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads of every side")
    p.add_argument("--trl-micro-batch", type=int, default=8, help="TRL per_device_train_batch_size")
    p.add_argument("--close-timeout", type=float, default=120.0,
                   help="seconds a stopped relayrl side may take to exit; past it every process of the side dumps "
                        "its threads' stacks into the side's log and is killed")
    p.add_argument("--logs", help="folder to copy each side's log into (default: the logs go with the temp folder)")
    p.add_argument("--override", nargs="*", default=[], help="extra key=value config overrides for every side")
    p.add_argument("--out", help="result JSON (default bench/results/time_to_accuracy.json; --quick: a temp file)")
    p.add_argument("--plot", help="plot PNG (default docs/img/time_to_accuracy.png; --quick: a temp file)")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny random model, 2x2 samples, 2 steps")
    p.add_argument("--side", choices=("trl",), help=argparse.SUPPRESS)  # internal: run the TRL side here
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    if "--quick" in (argv if argv is not None else sys.argv[1:]):
        p.set_defaults(**QUICK)  # explicit flags still win
    a = p.parse_args(argv)
    a.sides = [s.strip() for s in a.sides.split(",") if s.strip()]
    if bad := [s for s in a.sides if s not in SIDES]:
        p.error(f"unknown sides {bad}; choose from {SIDES}")
    if a.eval_every < 1 or a.max_steps < 1 or a.eval_size < 1:
        p.error("--eval-every, --eval-size and --max-steps must be >= 1")
    return a


def shared_overrides(a: argparse.Namespace) -> list[str]:
    """The config overrides every side gets: model, eval schedule and size, T=1, steps, seed, threads, quiet logs."""
    over = [f"model.path={a.model}", f"eval.every={a.eval_every}", f"eval.size={a.eval_size}", "eval.temperature=1.0",
            "sampling.temperature=1.0", "eval.at_start=true", "eval.at_end=true", f"run.steps={a.max_steps}",
            f"run.seed={a.seed}", f"run.threads={a.threads}", "run.save_final=false", "run.print_samples=0",
            "run.log_trajectories=false", "run.trackers=[jsonl]"]
    return over + (QUICK_OVERRIDES if a.quick else []) + a.override


def side_overrides(side: str, a: argparse.Namespace) -> list[str]:
    """What differs between the relayrl sides: the scheduler only (decoupled loss is async's default)."""
    if side != "async":
        return []
    over = ["scheduler.mode=async", f"scheduler.max_staleness={a.staleness}"]
    if a.separate:
        over += ["scheduler.placement=separate", "scheduler.producer_threads=1", f"run.threads={max(1, a.threads - 1)}"]
    return over


def stop_rule(a: argparse.Namespace):
    """Shared by all sides, checked at each eval: 'target' when pass@1 >= --target, 'budget' past --budget-min."""
    def should_stop(points: list[dict]) -> str | None:
        if points and points[-1]["pass@1"] >= a.target:
            return "target"
        if points and points[-1]["wall_s_excl_eval"] >= a.budget_min * 60:
            return "budget"
        return None
    return should_stop


def relayrl_curve(rows: list[dict]) -> tuple[list[dict], int, int]:
    """Eval points of a relayrl metrics.jsonl with the training seconds and samples up to each; steps and samples
    trained in all."""
    points, wall, samples, steps = [], 0.0, 0, 0
    for r in rows:
        if "time/step_s" in r:
            wall, samples, steps = wall + r["time/step_s"], samples + int(r["train/samples"]), steps + 1
        if "eval/pass@1" in r:
            points.append(_common.curve_point(r["step"], samples, wall, r))
    return points, steps, samples


STEP_KEYS = {"step_s": "time/step_s", "rollout_s": "time/rollout_s", "wait_s": "time/wait_for_batch_s",
             "train_s": "time/train_s", "sync_s": "time/weight_sync_s", "len_mean": "rollout/response_len_mean",
             "truncated": "rollout/truncated_frac", "reward": "rollout/reward_mean",
             # what the engines did (a producer's, for an async side), and why an async producer idled
             "rows_per_step": "engine/rows_per_step", "decode_ms": "engine/busy_ms_per_step",
             "engine_busy": "engine/busy_frac", "held": "rollout/held_frac", "lag": "rollout/engine_version_lag",
             "weight_load_s": "rollout/weight_load_s", "weight_pause_s": "rollout/weight_pause_s",
             "weight_stage_s": "rollout/weight_stage_s",
             "expired": "rollout/groups_expired"}


def relayrl_steps(rows: list[dict]) -> list[dict]:
    """Each training step's seconds by phase and its response lengths: where a side's time went (a long tail of
    response lengths shows as a high truncated fraction and a rollout far above the mean length's share)."""
    return [{"step": r["step"], **{k: round(r[m], 4) for k, m in STEP_KEYS.items() if m in r}}
            for r in rows if "time/step_s" in r]


def child_env(a: argparse.Namespace) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": str(a.threads), "PYTHONWARNINGS": "ignore", "PYTHONFAULTHANDLER": "1"}


def run_relayrl(side: str, a: argparse.Namespace, tmp: str) -> dict:
    """`relayrl train` in a subprocess, watched through its metrics.jsonl; interrupted (SIGTERM: the run closes its
    engines and producer) at the first eval where the stop rule fires."""
    over = [*shared_overrides(a), *side_overrides(side, a), f"run.output_dir={tmp}", f"run.name={side}"]
    cfg = resolve(load_run_config(a.config, over), quiet=True)  # a bad override fails here, named
    metrics = Path(tmp) / side / "metrics.jsonl"
    should_stop, stopped, close = stop_rule(a), False, None
    t0 = time.perf_counter()
    with open(Path(tmp) / f"{side}.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "relayrl.cli", "train", "--config", a.config, *over],
                                stdout=log, stderr=subprocess.STDOUT, env=child_env(a), cwd=_common.REPO)
        while proc.poll() is None:
            time.sleep(0.5)
            points = relayrl_curve(read_jsonl(metrics))[0] if metrics.is_file() else []
            if should_stop(points):
                stopped = True
                close = stop_side(proc, a.close_timeout)
                break
    if a.logs:
        Path(a.logs).mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(tmp) / f"{side}.log", Path(a.logs) / f"{side}.log")
    if proc.returncode and not stopped:
        sys.exit(f"relayrl {side} failed (exit {proc.returncode}):\n{(Path(tmp) / f'{side}.log').read_text()[-4000:]}")
    rows = read_jsonl(metrics)
    return {"curve": relayrl_curve(rows)[0], "steps": relayrl_steps(rows), "process_s": time.perf_counter() - t0,
            "interrupted": stopped,  # stopped by the rule, not at run.steps
            "close": close,  # SIGTERM to exit: the run's shutdown (engines, producer, weight channel)
            "settings": {"scheduler": cfg.scheduler.mode, "max_staleness": cfg.scheduler.max_staleness,
                         "placement": cfg.scheduler.placement, "decoupled": cfg.algo.decoupled,
                         "gradient_checkpointing": cfg.model.gradient_checkpointing, "engine_dtype": cfg.engine.dtype,
                         "autocast_bf16": cfg.model.autocast_bf16}}


def stop_side(proc: subprocess.Popen, timeout: float, dump_s: float = 3.0) -> dict:
    """SIGTERM a relayrl side and time its exit. One that outlives `timeout` is a shutdown bug to find, not just
    to kill: each of its processes first gets SIGABRT, which faulthandler (PYTHONFAULTHANDLER, set in child_env)
    turns into every thread's stack in the side's log."""
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGTERM)  # SIGINT: ignored when this runs as a background job
    try:
        proc.wait(timeout=timeout)
        return {"seconds": round(time.perf_counter() - t0, 2), "killed": False}
    except subprocess.TimeoutExpired:
        tree = [int(pid) for pid in descendants(proc.pid)]  # the producer, judge workers, compiler children
        for pid in [proc.pid, *tree]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGABRT)
        time.sleep(dump_s)  # for the dumps to be written
        for pid in [proc.pid, *tree]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
        return {"seconds": round(time.perf_counter() - t0, 2), "killed": True, "processes": 1 + len(tree)}


def run_trl_child(a: argparse.Namespace, tmp: str) -> dict:
    """This script with --side trl in a subprocess (TRL's imports and threads stay out of the driver)."""
    out = os.path.join(tmp, "trl.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--side", "trl", "--result-file", out, "--config", a.config,
           "--model", a.model, "--target", str(a.target), "--eval-every", str(a.eval_every), "--eval-size",
           str(a.eval_size), "--budget-min", str(a.budget_min), "--max-steps", str(a.max_steps), "--seed", str(a.seed),
           "--threads", str(a.threads), "--trl-micro-batch", str(a.trl_micro_batch), *(["--quick"] if a.quick else []),
           "--override", *a.override]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=child_env(a), cwd=_common.REPO, stdout=sys.stderr)
    if proc.returncode:
        sys.exit(f"the TRL side failed with exit code {proc.returncode}")
    with open(out) as f:
        return json.load(f) | {"process_s": time.perf_counter() - t0}


def run_trl_side(a: argparse.Namespace) -> None:
    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    cfg = load_run_config(a.config, shared_overrides(a))
    res = _tta_trl.run_trl(cfg, a.eval_every, a.trl_micro_batch, stop_rule(a))
    _common.write_json(a.result_file, res)


def settle(side: dict, should_stop) -> dict:
    """Cut a side's curve at the first eval where the stop rule fires (a relayrl run goes on while the eval is read;
    a rule can fire at the last eval too) and say why it stopped; steps and samples trained up to there."""
    points = side["curve"]
    first = next((i for i in range(len(points)) if should_stop(points[: i + 1])), None)
    if first is not None:
        points = points[: first + 1]
    return {"curve": points, "stopped_by": should_stop(points) if first is not None else "max_steps",
            "steps_trained": points[-1]["step"], "samples_trained": points[-1]["samples"]}


def to_target(side: dict, target: float) -> dict:
    """Time, samples and steps at the first eval at or above the target (None when never reached)."""
    hit = next((p for p in side["curve"] if p["pass@1"] >= target), None)
    return {"reached_target": hit is not None, "time_to_target_s": hit and hit["wall_s_excl_eval"],
            "samples_to_target": hit and hit["samples"], "steps_to_target": hit and hit["step"],
            "wall_s_excl_eval_total": side["curve"][-1]["wall_s_excl_eval"],
            "eval_s_total": sum(p["eval_s"] for p in side["curve"])}


def ratio(num: dict | None, den: dict | None, key: str, total: str) -> dict:
    """num / den of `key` (time or samples to target). A side that missed the target gives a bound from its
    total: missing in num -> num's true value is above its total (lower bound), in den -> upper bound."""
    if num is None or den is None:
        return {"value": None, "kind": "not_run", "bound": None}
    n, d = num[key], den[key]
    if d == 0 or (d is None and n == 0):  # a side at the target before training: no time to compare
        return {"value": None, "kind": "undetermined", "bound": None}
    if n is not None and d is not None:
        return {"value": n / d, "kind": "exact", "bound": None}
    if d is not None and d > 0:
        v = num[total] / d
        return {"value": None, "kind": "lower_bound", "bound": f">= {v:.3g}", "bound_value": v}
    if n is not None and den[total] > 0:
        v = n / den[total]
        return {"value": None, "kind": "upper_bound", "bound": f"<= {v:.3g}", "bound_value": v}
    return {"value": None, "kind": "undetermined", "bound": None}


def ratios_by_step(num: dict | None, den: dict | None) -> dict[str, float]:
    """num / den of training seconds at every eval step both curves have (step 0 excluded). Time to target moves by a
    whole eval interval when one side crosses an eval early or late; the ratio at equal steps does not."""
    if num is None or den is None:
        return {}
    den_s = {p["step"]: p["wall_s_excl_eval"] for p in den.get("curve", ())}
    return {str(p["step"]): p["wall_s_excl_eval"] / den_s[p["step"]] for p in num.get("curve", ())
            if p["step"] > 0 and den_s.get(p["step"], 0) > 0}


def ratios(m: dict) -> dict:
    out = {}
    for name, num, den in (("async_vs_sync", "sync", "async"), ("relayrl_vs_trl", "trl", "sync")):
        out[f"{name}_time_at_equal_steps"] = ratios_by_step(m.get(num), m.get(den))
        for what, key, total in (("time", "time_to_target_s", "wall_s_excl_eval_total"),
                                 ("samples", "samples_to_target", "samples_trained")):
            r = ratio(m.get(num), m.get(den), key, total)
            out[f"{name}_{what}_to_acc"] = r.pop("value")
            out[f"{name}_{what}_to_acc_kind"] = r.pop("kind")
            out[f"{name}_{what}_to_acc_bound"] = r.pop("bound")
    return out


def plot(metrics: dict, target: float, path: Path) -> None:
    import matplotlib  # optional heavy dependency (bench extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(11, 4))
    for side, m in metrics.items():
        c = m["curve"]
        y, err = [p["pass@1"] for p in c], [p["stderr"] for p in c]
        ax_t.errorbar([p["wall_s_excl_eval"] / 60 for p in c], y, yerr=err, marker="o", capsize=3, label=side)
        ax_s.errorbar([p["samples"] for p in c], y, yerr=err, marker="o", capsize=3, label=side)
    for ax, xlabel in ((ax_t, "training minutes (eval excluded)"), (ax_s, "samples trained")):
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target}")
        ax.set(xlabel=xlabel, ylabel="held-out pass@1 (T=1)", ylim=(0, 1))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("time to accuracy: relayrl sync / async vs TRL GRPOTrainer")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)  # atomic: a crash never leaves half a PNG


def outputs(a: argparse.Namespace) -> tuple[Path, Path]:
    if a.quick:  # a smoke run never replaces the recorded result
        d = Path(tempfile.mkdtemp(prefix="tta_quick_"))
        return Path(a.out or d / "time_to_accuracy_quick.json"), Path(a.plot or d / "time_to_accuracy_quick.png")
    return (Path(a.out or _common.REPO / "bench/results/time_to_accuracy.json"),
            Path(a.plot or _common.REPO / "docs/img/time_to_accuracy.png"))


def main() -> None:
    a = parse_args()
    if a.side:
        return run_trl_side(a)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from relayrl.models import resolve_model_path, tiny_model

    a.model = str(tiny_model()) if a.quick else str(resolve_model_path(a.model))
    try:  # a bad config or override fails here, named, before any side starts
        cfg = load_run_config(a.config, shared_overrides(a))
        for side in a.sides:
            load_run_config(a.config, shared_overrides(a) + side_overrides(side, a))
    except (ConfigError, InputError, OSError) as e:
        sys.exit(f"error: {e}")
    a.trl_micro_batch = min(a.trl_micro_batch, cfg.data.batch_size * cfg.data.group_size)
    if "trl" in a.sides and importlib.util.find_spec("trl") is None:  # before the relayrl sides spend their hour
        sys.exit("error: the trl side needs TRL: .venv/bin/pip install '.[bench]' (or --sides sync,async)")
    if "trl" in a.sides and (problem := _tta_trl.settings_problem(cfg, a.trl_micro_batch)):
        sys.exit(f"error: {problem}")
    out, png = outputs(a)
    load = _common.load_before_run()
    metrics = {}
    with tempfile.TemporaryDirectory(prefix="tta_runs_") as tmp:
        for side in a.sides:
            print(f"{side} ...", file=sys.stderr, flush=True)
            metrics[side] = run_trl_child(a, tmp) if side == "trl" else run_relayrl(side, a, tmp)
            metrics[side] |= settle(metrics[side], stop_rule(a))
            metrics[side] |= to_target(metrics[side], a.target)
            # after every side, so a run cut short (a restart, a kill) keeps the sides it finished
            _common.write_json(out, result(a, cfg, metrics, load, png, complete=len(metrics) == len(a.sides)))
    plot(metrics, a.target, png)
    print(json.dumps({"out": str(out), "plot": str(png), **ratios(metrics)}, indent=2))


def result(a: argparse.Namespace, cfg, metrics: dict, load: float, png: Path, complete: bool) -> dict:
    """The result JSON: sides run so far, their ratios, the shared workload and the checks."""
    return {**_common.result_header("time_to_accuracy"), "complete": complete, "sides_done": list(metrics),
            "metrics": metrics, "ratios": ratios(metrics),
            "workload": {"config": a.config, "model": a.model, "target": a.target, "eval_every": a.eval_every,
                         "eval_size": a.eval_size, "eval_n": cfg.eval.n, "budget_min": a.budget_min,
                         "max_steps": a.max_steps, "prompts_per_step": cfg.data.batch_size,
                         "group_size": cfg.data.group_size, "lr": cfg.train.lr,
                         "max_new_tokens": cfg.sampling.max_new_tokens, "temperature": cfg.sampling.temperature,
                         "staleness": a.staleness, "separate": a.separate, "seed": a.seed, "threads": a.threads,
                         "overrides": shared_overrides(a), "quick": a.quick},
            "checks": {"loadavg_1min_at_start": load,
                       "pass_at_step0": {s: m["curve"][0]["pass@1"] for s, m in metrics.items()}},
            "notes": NOTES, "plot": str(png.relative_to(_common.REPO) if png.is_relative_to(_common.REPO) else png)}


if __name__ == "__main__":
    main()
