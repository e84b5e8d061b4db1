#!/usr/bin/env python
"""Learning runs as a user runs them: `bench/learning.py COMMAND` (`COMMAND --help` for its options).

Every command runs the real `relayrl train` in subprocesses, one run after another (side by side they would share
the cores and skew every wall clock), and reads the runs' metrics.jsonl: a recorded run (learning_run), the presets
compared (compare_presets), the README's job timed (readme_job), async against sync (async_vs_sync), a task with
and without the user's tool (tool_learning, bench/_tool_learning.py), a bf16 engine with and without the rollout
correction (rollout_correction). Each command's docstring says what it measures and how.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common
from _tool_learning import tool_learning

from relayrl.common.files import read_jsonl
from relayrl.config.presets import PRESETS
from relayrl.tracking.plot import plot_run

RUN_EVAL_KEYS = ("eval/pass", "eval/maj", "eval/solved", "eval/recovered", "eval/retry", "eval/planted")
QUICK = ["model.autocast_bf16=false", "engine.dtype=float32", "data.batch_size=2", "data.group_size=4",
         "data.train.size=8", "sampling.max_new_tokens=12", "eval.size=2", "eval.n=1", "eval.every=0",
         "run.tensorboard=false", "run.save_final=false", "run.log_trajectories=false", "run.print_samples=0",
         "judge.workers=1",
         # a random model never earns the math reward; the tests' parity reward gives mixed groups (which
         # DAPO's dynamic sampling needs) from tests/rewards_for_tests.py
         "judge.reward_fn=rewards_for_tests:parity_reward", "judge.kwargs={}"]
VARIANTS = {
    "sync": [],
    "async": ["scheduler.mode=async", "scheduler.max_staleness=2", "scheduler.max_concurrency=16"],
    "async_separate": ["scheduler.mode=async", "scheduler.max_staleness=2", "scheduler.max_concurrency=16",
                       "scheduler.placement=separate", "scheduler.producer_threads=1", "run.threads=1"],
}


# ---- learning_run ------------------------------------------------------------------------------------------------
def learning_run(argv: list[str]) -> None:
    """A recorded learning run: `relayrl train` on a config, held-out pass rate before and after, and the curve.

    Runs the real CLI in a subprocess, then reads the run's metrics.jsonl and writes bench/results/NAME.json
    (pass_before, pass_after, their standard errors, minutes, the eval curve) and docs/img/NAME.png (reward and
    pass-rate curves).

        .venv/bin/python bench/learning.py learning_run --name learning_arithmetic_grpo -- \\
            --config examples/arithmetic_grpo.yaml run.steps=40 eval.every=10
    """
    p = _common.parser("learning_run", learning_run.__doc__)
    p.add_argument("--name", required=True, help="result name (bench/results/NAME.json, docs/img/NAME.png)")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="arguments for `relayrl train` after --")
    a = p.parse_args(argv)
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
                    "eval_curve": [{k: r[k] for k in r if k == "step" or k.startswith(RUN_EVAL_KEYS)} for r in evals],
                    "train_reward_first5": [r["rollout/reward_mean"] for r in steps[:5]],
                    "train_reward_last5": [r["rollout/reward_mean"] for r in steps[-5:]]},
        "ratios": {}, "run_dir": str(run_dir), "plot": str(png.relative_to(_common.REPO))}
    _common.write_json(_common.REPO / "bench" / "results" / f"{a.name}.json", result)
    print(result)

# ---- compare_presets ---------------------------------------------------------------------------------------------
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


def preset_ratios(results: dict[str, dict]) -> dict[str, float]:
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


def presets_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = _common.parser("compare_presets", compare_presets.__doc__)
    p.add_argument("--presets", default=",".join(PRESETS), help="comma-separated preset names")
    p.add_argument("--config", default="examples/arithmetic_grpo.yaml")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="/tmp/relayrl_compare_presets", help="run.output_dir of the runs")
    p.add_argument("--out", default=None, help="result JSON (default bench/results/compare_presets.json)")
    p.add_argument("--plot", default=None, help="curves PNG (default docs/img/compare_presets.png)")
    p.add_argument("--quick", action="store_true", help="tiny random model, 2 steps, tiny sizes (a smoke test)")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="more `relayrl train` overrides after --")
    args = p.parse_args(argv)
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


def compare_presets(argv: list[str]) -> None:
    """Compare algorithm presets on one task: held-out pass@1 before/after, wall-clock, and all curves in one plot.

    Each preset runs the real CLI (`relayrl train --config CONFIG algo.preset=P ...`) in its own subprocess,
    one after another (running them side by side would make them compete for the cores and skew wall-clock).
    Every run gets the same seed, data, prompts per step and eval set, so the presets see the same prompts in
    the same order. Writes bench/results/compare_presets.json (per preset: pass_before, pass_after, minutes,
    median step seconds; ratios: wall-clock and pass_after relative to grpo) and docs/img/compare_presets.png.

        .venv/bin/python bench/learning.py compare_presets --steps 30     # every preset, arithmetic_grpo.yaml
        .venv/bin/python bench/learning.py compare_presets --presets grpo,ppo -- train.lr=5e-6
        .venv/bin/python bench/learning.py compare_presets --quick        # smoke run on the tiny random model
    """
    args, extra = presets_args(argv)
    results = {}
    for preset in args.presets.split(","):
        print(f"== {preset}", flush=True)
        results[preset] = run_preset(preset, args, extra)
        print({k: v for k, v in results[preset].items() if k != "eval_curve"}, flush=True)
    done = {k: r for k, r in results.items() if "error" not in r}
    png = plot_run([r["run_dir"] for r in done.values()], args.plot, labels=list(done)) if done else None
    result = _common.result_header("compare_presets") | {
        "config": args.config, "steps": args.steps, "overrides": extra, "metrics": results,
        "ratios": preset_ratios(results), "plot": str(png) if png else None}
    _common.write_json(args.out, result)
    print(f"wrote {args.out} and {png}")
    if len(done) < len(results):
        sys.exit(f"failed presets: {sorted(set(results) - set(done))}")

# ---- readme_job --------------------------------------------------------------------------------------------------
def readme_args(argv: list[str]) -> argparse.Namespace:
    p = _common.parser("readme_job", readme_job.__doc__)
    p.add_argument("--cpu", choices=["native", "avx2"], default="native")
    p.add_argument("--config", default="examples/arithmetic_grpo.yaml")
    p.add_argument("--out", help="result file (default bench/results/readme_job_<cpu>.json; overrides: not written)")
    p.add_argument("overrides", nargs="*")
    return p.parse_args(argv)


def readme_run(a, tmp: str) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(_common.AVX2_ENV if a.cpu == "avx2" else {})}
    if a.cpu == "avx2":  # the dtype measurement is cached per switch setting: this measures AVX2 behaviour
        code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
        cap = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout.strip()
        assert cap == "AVX2", cap
    r = _common.train_run(a.config, a.overrides, tmp, env)
    output, wall, peaks, run_dir = r["output"], r["wall_s"], r["peaks"], r["run_dir"]
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in rows if "eval/pass@1" in r]
    steps = [r for r in rows if "train/loss" in r]
    precision = next((line for line in output.splitlines() if line.startswith("precision:")), "")
    return {"wall_s": round(wall, 1), "wall_min": round(wall / 60, 2), "peak_rss_gb": round(peak / 1e9, 3),
            "judge_workers_peak_rss_gb": round(peaks["workers"] / 1e9, 3),
            "tree_peak_rss_gb": round(peaks["tree"] / 1e9, 3),
            "steps": len(steps), "precision": precision,
            "step_s_median": sorted(r["time/step_s"] for r in steps)[len(steps) // 2],
            "rollout_s_median": sorted(r["time/rollout_s"] for r in steps)[len(steps) // 2],
            "train_s_median": sorted(r["time/train_s"] for r in steps)[len(steps) // 2],
            "eval": [{"step": r["step"], "pass@1": r["eval/pass@1"], "seconds": round(r.get("time/eval_s", 0.0), 1)}
                     for r in evals],
            "len_mean_by_step": [round(r.get("rollout/response_len_mean", 0.0), 1) for r in steps],
            "truncated_frac_by_step": [round(r.get("rollout/truncated_frac", 0.0), 3) for r in steps],
            "train_s_by_step": [round(r["time/train_s"], 2) for r in steps],
            "rollout_s_by_step": [round(r["time/rollout_s"], 2) for r in steps],
            # samples whose advantages were all 0, left out of the forward/backward (TrainController._contributing)
            "samples_skipped_zero_adv_by_step": [r.get("train/samples_skipped_zero_adv") for r in steps],
            # the trainer's high-water mark after each step: where in the run the peak came
            "peak_rss_gb_by_step": [round(r["mem/peak_rss_gb"], 3) for r in steps if "mem/peak_rss_gb" in r]}


def readme_job(argv: list[str]) -> None:
    """The README's main job, timed as a user runs it: wall clock, peak RSS, pass@1 before and after.

    Runs `relayrl train --config examples/arithmetic_grpo.yaml` (the README's first command after setup) as a
    subprocess and reads its run folder. `--cpu avx2` runs it as on a CPU without AVX-512 or native bf16
    (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2: bf16 matmuls drop to ~1 GFLOP/s, so `engine.dtype: auto`
    picks float32), which is how an AVX2-only laptop behaves on any x86 machine.

    `peak_rss_gb` is the trainer process's own high-water mark: getrusage(RUSAGE_CHILDREN).ru_maxrss is the largest
    single descendant's peak, never a sum, and the trainer is the largest. The judge workers (the trainer's own
    child processes, about 0.15 GB together) are sampled every 50 ms and reported apart (`judge_workers_peak_rss_gb`);
    `tree_peak_rss_gb` is the sampled peak of trainer + workers together.

        .venv/bin/python bench/learning.py readme_job                  # this CPU as it is
        .venv/bin/python bench/learning.py readme_job --cpu avx2       # as on an AVX2-only CPU
        .venv/bin/python bench/learning.py readme_job run.steps=3      # overrides for a shorter check (not recorded)
    """
    a = readme_args(argv)
    load = _common.load_before_run()
    allocator = ("RELAYRL_MALLOC_ARENAS", "MALLOC_ARENA_MAX", "RELAYRL_MMAP_THRESHOLD")  # tune_allocator reads them
    env_note = (_common.AVX2_ENV if a.cpu == "avx2" else {}) | {k: os.environ[k] for k in allocator if k in os.environ}
    os.environ.update(env_note)  # machine_info measures what this setting does
    res = {**_common.result_header(f"readme_job_{a.cpu}"), "load_before": load, "cpu_setting": a.cpu,
           "env": env_note, "config": a.config, "overrides": a.overrides}
    with tempfile.TemporaryDirectory(prefix="bench_readme_") as tmp:
        res |= readme_run(a, tmp)
    print(json.dumps(res, indent=2))
    out = a.out or (None if a.overrides else f"bench/results/readme_job_{a.cpu}.json")
    if out:
        _common.write_json(out, res)

# ---- async_vs_sync -----------------------------------------------------------------------------------------------
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


def async_vs_sync(argv: list[str]) -> None:
    """Asynchronous vs synchronous RL: wall-clock for the same number of trained samples, and the reward curves.

    Workload: SmolLM2-135M-Instruct on 2-term arithmetic at temperature 1.0 with a 512-token cap. About one
    sample in six loops until the cap, so response lengths are long-tailed: a synchronous step waits for its
    slowest sample while the engine decodes a nearly empty batch; an asynchronous producer keeps the batch
    full with the next prompts. Every variant uses the same config, seed, prompts and number of steps
    (= trained samples); only `scheduler.*` differs. Runs go one after another in this process's children.

        .venv/bin/python bench/learning.py async_vs_sync                    # sync, async (colocated), async (separate)
        .venv/bin/python bench/learning.py async_vs_sync --steps 2 --quick  # smoke run on the tiny model
    """
    p = _common.parser("async_vs_sync", async_vs_sync.__doc__)
    p.add_argument("--config", default="examples/arithmetic_grpo.yaml")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--override", nargs="*", default=[], help="extra key=value overrides for every variant")
    p.add_argument("--quick", action="store_true", help="tiny model smoke run")
    p.add_argument("--out", default="bench/results/async_vs_sync.json")
    a = p.parse_args(argv)
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

# ---- rollout_correction -----------------------------------------------------------------------------------------
CORRECTION_KEYS = ("train/mismatch_kl", "train/rollout_is_mean", "train/rollout_is_min", "train/rollout_is_max",
                   "train/rollout_is_truncated_frac", "train/rollout_is_masked_frac", "train/rollout_is_vetoed_frac",
                   "train/logprob_diff_engine_abs", "train/logprob_diff_engine_max")


def correction_run(on: bool, a: argparse.Namespace, out_dir: str) -> dict:
    """One README job with a bf16 engine, the correction on or off; its pass@1, mismatch and timings."""
    over = [*(QUICK if a.quick else []), "engine.dtype=bfloat16", f"algo.rollout_correction.enabled={str(on).lower()}",
            f"run.seed={a.seed}", f"run.name=correction_{'on' if on else 'off'}", *a.overrides]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if a.quick:
        from relayrl.models import tiny_model

        over.insert(0, f"model.path={tiny_model('qwen2')}")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_common.REPO / "tests"), env.get("PYTHONPATH")]))
    r = _common.train_run(a.config, over, out_dir, env)
    rows = read_jsonl(r["run_dir"] / "metrics.jsonl")
    evals, steps = [x for x in rows if "eval/pass@1" in x], [x for x in rows if "train/loss" in x]
    lines = r["output"].splitlines()
    return {"overrides": over, "wall_min": round(r["wall_s"] / 60, 2),
            "precision": next((x for x in lines if x.startswith("precision:")), ""),
            "correction": next((x for x in lines if x.startswith("rollout correction:")), ""),
            "pass_before": evals[0]["eval/pass@1"] if len(evals) > 1 else None,
            "pass_after": evals[-1]["eval/pass@1"] if evals else None,
            "eval_samples": int(evals[-1]["eval/samples"]) if evals else 0,
            "eval_curve": [{"step": x["step"], "pass@1": x["eval/pass@1"]} for x in evals],
            "reward_by_step": [round(x["rollout/reward_mean"], 4) for x in steps],
            "step_s_median": statistics.median(x["time/step_s"] for x in steps),
            # per step, and their mean over the run (a key absent when the correction is off)
            "by_step": {k: [x.get(k) for x in steps] for k in CORRECTION_KEYS},
            "mean": {k: statistics.fmean(x[k] for x in steps) for k in CORRECTION_KEYS if all(k in x for x in steps)}}


def rollout_correction(argv: list[str]) -> None:
    """The README job with a bf16 engine, with and without the rollout correction: pass@1 and mismatch KL.

    Two `relayrl train --config examples/arithmetic_grpo.yaml engine.dtype=bfloat16` subprocesses, one after the
    other, with the same seed, prompts and eval set; only algo.rollout_correction.enabled differs (true: token
    ratios truncated at 2, samples vetoed below 1e-4, the defaults). Reads each run's metrics.jsonl and writes
    bench/results/rollout_correction.json: held-out pass@1 before and after (with its standard error), the
    train/mismatch_kl curve (k3 of the engine against the trainer, measured in both runs) and the correction's
    ratio statistics and fractions, the precision and correction lines each run printed, and wall clock.

        .venv/bin/python bench/learning.py rollout_correction                  # both runs, recorded
        .venv/bin/python bench/learning.py rollout_correction run.steps=3      # a shorter check (not recorded)
        .venv/bin/python bench/learning.py rollout_correction --quick          # smoke run on the tiny model
    """
    p = _common.parser("rollout_correction", rollout_correction.__doc__)
    p.add_argument("--config", default="examples/arithmetic_grpo.yaml")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny random model, tiny sizes (a smoke test)")
    p.add_argument("--out", help="result file (default bench/results/rollout_correction.json; overrides, --quick: "
                                 "not written)")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    res = {**_common.result_header("rollout_correction"), "load_before": _common.load_before_run(),
           "config": a.config, "seed": a.seed, "overrides": a.overrides}
    runs = {}
    with tempfile.TemporaryDirectory(prefix="bench_correction_") as tmp:
        for on in (False, True):
            name = "on" if on else "off"
            print(f"== correction {name}", flush=True)
            os.makedirs(Path(tmp) / name)
            runs[name] = correction_run(on, a, str(Path(tmp) / name))
            print({k: runs[name][k] for k in ("correction", "pass_before", "pass_after", "wall_min", "mean")},
                  flush=True)
    for r in runs.values():
        if r["pass_after"] is not None:
            r["pass_after_stderr"] = _common.std_err(r["pass_after"], r["eval_samples"])
    res |= {"metrics": runs, "ratios": {"on_vs_off_wall": runs["on"]["wall_min"] / max(runs["off"]["wall_min"], 1e-9)}}
    out = a.out or (None if a.overrides or a.quick else "bench/results/rollout_correction.json")
    if out:
        _common.write_json(out, res)
        print(f"wrote {out}")


COMMANDS = {"learning_run": learning_run, "compare_presets": compare_presets, "readme_job": readme_job,
            "async_vs_sync": async_vs_sync, "tool_learning": tool_learning, "rollout_correction": rollout_correction}

if __name__ == "__main__":
    _common.dispatch(__doc__, COMMANDS)
