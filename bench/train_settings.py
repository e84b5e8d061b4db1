#!/usr/bin/env python
"""The README job's training phase under different train settings, side by side: fit time and peak memory.

Each side is a named list of config overrides (e.g. gradient checkpointing on or off, the micro-batch size).
A side runs in its own child process, which builds the run from examples/arithmetic_grpo.yaml plus the side's
overrides and steps it as relayrl.run.loop.train_colocated does (rollout, release the engine's memory, fit,
weight sync). It records each fit's wall time and the process's high-water mark during the fits only (VmHWM,
reset before each fit by writing 5 to /proc/self/clear_refs). Sides alternate round by round; every side
starts from the same weights, data and seeds, so the first step fits the same batch on every side.

    .venv/bin/python bench/train_settings.py                  # shipped vs no checkpointing at 256/512 tokens
    .venv/bin/python bench/train_settings.py --cpu avx2       # as on an AVX2-only CPU (bench/_common.AVX2_ENV)
    .venv/bin/python bench/train_settings.py --side 'small=train.micro_batch_tokens=512' --side 'shipped='
    .venv/bin/python bench/train_settings.py --side kernel= --side 'torch=env.RELAYRL_KERNELS_OFF=segment_attention'

An override `env.NAME=VALUE` sets an environment variable in that side's child instead of a config key.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import _common

DEFAULT_SIDES = ["shipped=",
                 "no_gc_256=model.gradient_checkpointing=false,train.micro_batch_tokens=256",
                 "no_gc_512=model.gradient_checkpointing=false,train.micro_batch_tokens=512"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="examples/arithmetic_grpo.yaml")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="alternating runs of every side")
    p.add_argument("--side", action="append", dest="sides",
                   help="NAME=key=value,key=value (repeatable; default: shipped, no_gc_256, no_gc_512)")
    p.add_argument("--cpu", choices=["native", "avx2"], default="native")
    p.add_argument("--out", default=None, help="default bench/results/train_settings[_avx2].json")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.sides = a.sides or DEFAULT_SIDES
    for spec in a.sides:
        if "=" not in spec:
            p.error(f"--side {spec!r}: expected NAME=key=value,... (NAME= for the config as shipped)")
    a.out = a.out or f"bench/results/train_settings{'_avx2' if a.cpu == 'avx2' else ''}.json"
    return a


def split_side(spec: str) -> tuple[str, list[str]]:
    name, _, overrides = spec.partition("=")
    return name, [o for o in overrides.split(",") if o]


def _vm_gb(key: str) -> float:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key))
    return int(line.split()[1]) * 1024 / 1e9


def run_child(a) -> dict:
    import relayrl.run.loop  # noqa: F401 - everything the CLI imports
    from relayrl.common.utils import trim_memory, tune_allocator
    from relayrl.config.schema import load_run_config
    from relayrl.run.build import build

    name, overrides = split_side(a.child)
    env = dict(o[len("env."):].split("=", 1) for o in overrides if o.startswith("env."))
    os.environ.update(env)
    overrides = [o for o in overrides if not o.startswith("env.")]
    tune_allocator()
    fit_s, peaks, tokens = [], [], []
    with tempfile.TemporaryDirectory(prefix="bench_settings_") as tmp:
        cfg = load_run_config(a.config, [f"run.output_dir={tmp}", "run.tensorboard=false", "eval.at_start=false",
                                         "eval.at_end=false", f"run.steps={a.steps}", "run.print_samples=0",
                                         *overrides])
        c = build(cfg)
        try:
            for _ in range(a.steps):
                batch, _ = c.rollouts.next_batch(c.train_ctl.version)
                c.rollouts.release_memory()
                trim_memory()
                Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts from RSS now
                t0 = time.perf_counter()
                metrics = c.train_ctl.fit(batch)
                fit_s.append(round(time.perf_counter() - t0, 2))
                peaks.append(round(_vm_gb("VmHWM"), 3))
                tokens.append(int(metrics.get("train/tokens", 0)))
                c.rollouts.push_weights(c.train_ctl)
                trim_memory()
        finally:
            c.close()
    return {"side": name, "overrides": overrides, "env": env, "fit_s": fit_s, "train_peak_gb": peaks,
            "trained_tokens": tokens}


def child(spec: str, a) -> dict:
    return _common.run_child(__file__, ["--child", spec, "--config", a.config, "--steps", str(a.steps)],
                             f"side {spec!r}", _common.AVX2_ENV if a.cpu == "avx2" else None)


def summarize(runs: list[dict], names: list[str]) -> dict:
    """Per side: median fit time of step 1 (the same batch on every side) and of all steps, max training peak."""
    out = {}
    for name in names:
        mine = [r for r in runs if r["side"] == name]
        out[name] = {"first_fit_s_median": statistics.median(r["fit_s"][0] for r in mine),
                     "fit_s_median": statistics.median(t for r in mine for t in r["fit_s"]),
                     "train_peak_gb_max": max(p for r in mine for p in r["train_peak_gb"]),
                     "overrides": mine[0]["overrides"], "env": mine[0].get("env", {})}
    base = out[names[0]]
    for name in names[1:]:
        out[name]["first_fit_vs_" + names[0]] = round(out[name]["first_fit_s_median"] / base["first_fit_s_median"], 3)
    return out


def main() -> None:
    a = parse_args()
    if a.child:
        _common.write_json(a.result_file, run_child(a))
        return
    load = _common.load_before_run()
    names = [split_side(s)[0] for s in a.sides]
    runs = [child(spec, a) for _ in range(a.rounds) for spec in a.sides]
    summary = summarize(runs, names)
    result = _common.result_header("train_settings") | {
        "load_before": load, "cpu": a.cpu, "env": _common.AVX2_ENV if a.cpu == "avx2" else {},
        "config": a.config, "steps": a.steps, "rounds": a.rounds, "summary": summary, "runs": runs}
    _common.write_json(a.out, result)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
