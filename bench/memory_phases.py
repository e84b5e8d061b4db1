#!/usr/bin/env python
"""Peak memory of the README's whole job, phase by phase: where the job's high-water mark comes from.

`bench/memory.py` steps the training loop alone; this runs the whole job the way `relayrl train` does
(relayrl.run.loop.train_colocated on examples/arithmetic_grpo.yaml: build, eval at start, rollout, train,
weight sync, eval, final save, close) in a child process, while a thread samples RSS every 2 ms and keeps, per
phase, the peak of the trainer process itself and, separately, the summed RSS of its child processes (the judge
workers: separate processes, never part of `peak_rss_gb`). It also keeps the engines' KV cache bytes per phase.

`peak_rss_gb` is the trainer process's own high-water mark (VmHWM), the figure `bench/readme_job.py` reports
for the whole job (getrusage RUSAGE_CHILDREN's ru_maxrss: the largest single descendant, not a sum).

    .venv/bin/python bench/memory_phases.py                       # README job, 2 steps, eval every step
    .venv/bin/python bench/memory_phases.py --steps 3 engine.kv_cache_gb=0.1
    .venv/bin/python bench/memory_phases.py --quick               # smoke run on the tiny random model
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path

import _common
from _common import descendants, proc_rss

GB = 1e9


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="examples/arithmetic_grpo.yaml")
    p.add_argument("--steps", type=int, default=2, help="training steps (eval runs at start, after each, at end)")
    p.add_argument("--eval-every", type=int, default=1, help="eval.every (0: eval at start and end only)")
    p.add_argument("--quick", action="store_true", help="tiny random model, 1 step, result not recorded")
    p.add_argument("--out", default="bench/results/memory_phases.json")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. engine.kv_cache_gb=0.2")
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    return p.parse_args(argv)


class Sampler:
    """Per phase: peak own RSS, peak summed RSS of the descendants, peak KV cache bytes, own RSS at entry."""

    def __init__(self, kv_bytes=lambda: 0, interval: float = 0.002):
        self.kv_bytes, self.interval = kv_bytes, interval
        self.phase, self.order, self.stats = "", [], {}
        self.set("imports")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def set(self, phase: str) -> None:
        if phase not in self.stats:
            self.order.append(phase)
            self.stats[phase] = {"entry": proc_rss("self"), "self": 0, "children": 0, "kv": 0}
        self.phase = phase

    def _run(self) -> None:
        pid, tick = os.getpid(), 0
        while not self._stop.is_set():
            s = self.stats[self.phase]
            s["self"] = max(s["self"], proc_rss("self"))
            s["kv"] = max(s["kv"], self.kv_bytes())
            if tick % 25 == 0:  # children change slowly: every 50 ms
                s["children"] = max(s["children"], sum(proc_rss(c) for c in descendants(pid)))
            tick += 1
            time.sleep(self.interval)

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join()
        return [{"phase": p, "peak_rss_gb": round(self.stats[p]["self"] / GB, 3),
                 "entry_rss_gb": round(self.stats[p]["entry"] / GB, 3),
                 "children_rss_gb": round(self.stats[p]["children"] / GB, 3),
                 "kv_cache_gb": round(self.stats[p]["kv"] / GB, 3)} for p in self.order]


def hwm_bytes() -> int:
    status = Path("/proc/self/status").read_text()
    return next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM"))


def instrument(c, sampler: Sampler) -> None:
    """Set the sampler's phase around each call the training loop makes (instance attributes shadow methods)."""
    step = {"n": 0}

    def phase(obj, name: str, label) -> None:
        inner = getattr(obj, name)

        def wrapped(*args, **kwargs):
            sampler.set(label() if callable(label) else label)
            try:
                return inner(*args, **kwargs)
            finally:
                sampler.set("between_phases")

        setattr(obj, name, wrapped)

    def rollout_label() -> str:
        step["n"] += 1
        return "rollout"

    phase(c.rollouts, "next_batch", rollout_label)
    phase(c.rollouts, "release_memory", "train")
    phase(c.train_ctl, "fit", "train")
    phase(c.rollouts, "push_weights", "weight_sync")
    phase(c.rollouts, "evaluate", lambda: "eval_start" if step["n"] == 0 else "eval")
    phase(c, "save_model", "final_save")


def run_job(a) -> dict:
    engines: list = []
    sampler = Sampler(lambda: sum(e.cache.nbytes() for e in engines if hasattr(e, "cache")))
    from relayrl.config.schema import load_run_config
    from relayrl.run.build import build
    from relayrl.run.loop import train_colocated

    with tempfile.TemporaryDirectory(prefix="bench_phases_") as tmp:
        over = [*a.overrides, f"run.output_dir={tmp}", f"run.steps={a.steps}", f"eval.every={a.eval_every}",
                "eval.at_start=true", "eval.at_end=true", "run.save_final=true", "run.print_samples=0"]
        cfg = load_run_config(a.config, over)
        sampler.set("build")
        c = build(cfg)
        engines += c.rollout_ctl.engines
        instrument(c, sampler)
        try:
            metrics = train_colocated(c)
        finally:
            sampler.set("close")
            c.close()
    phases = sampler.stop()
    top = max(phases, key=lambda p: p["peak_rss_gb"])
    return {"peak_rss_gb": round(hwm_bytes() / GB, 3), "peak_phase": top["phase"],
            "children_peak_rss_gb": max(p["children_rss_gb"] for p in phases), "phases": phases,
            "eval_pass@1": metrics.get("eval/pass@1"),
            "settings": {"engine_dtype": cfg.engine.dtype, "max_batch_size": cfg.engine.max_batch_size,
                         "kv_cache_gb": getattr(cfg.engine, "kv_cache_gb", None),
                         "micro_batch_tokens": cfg.train.micro_batch_tokens,
                         "gradient_checkpointing": cfg.model.gradient_checkpointing}}


def main() -> None:
    a = parse_args()
    if a.result_file:
        _common.write_json(a.result_file, run_job(a))
        return
    overrides = list(a.overrides)
    if a.quick:
        from relayrl.models import tiny_model

        overrides.append(f"model.path={tiny_model()}")
        a.steps = 1
    load = _common.load_before_run()
    res = {**_common.result_header("memory_phases"), "load_before": load, "config": a.config,
           "overrides": a.overrides, "steps": a.steps, "eval_every": a.eval_every}
    res |= _common.run_child(__file__, ["--config", a.config, "--steps", str(a.steps), "--eval-every",
                                        str(a.eval_every), *overrides], "the job")
    print(json.dumps(res, indent=2))
    if not a.quick:
        _common.write_json(a.out, res)


if __name__ == "__main__":
    main()
