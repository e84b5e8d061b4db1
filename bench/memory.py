#!/usr/bin/env python
"""Where the memory goes: `bench/memory.py COMMAND` (`COMMAND --help` for its options).

parts and memory_phases measure the README job's peak part by part and phase by phase; step_memory,
train_memory_trace and backward_peak (bench/_memory_trace.py) follow resident memory step by step, micro-batch by
micro-batch and part by part of a backward. Each command's docstring says what it measures and how.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

import _common
from _common import PhaseSampler, descendants, proc_rss, rss_bytes
from _memory_trace import backward_peak, step_memory, train_memory_trace

GB = 1e9


# ---- parts -----------------------------------------------------------------------------------------------------
def parts_args(argv: list[str]) -> argparse.Namespace:
    p = _common.parser("parts", parts.__doc__)
    p.add_argument("--config", default="examples/arithmetic_grpo.yaml")
    p.add_argument("--steps", type=int, default=3, help="training steps measured (memory is steady after 2)")
    p.add_argument("--no-trl", action="store_true", help="skip the TRL GRPOTrainer side")
    p.add_argument("--quick", action="store_true", help="tiny random model, 1 step, no TRL, result not recorded")
    p.add_argument("--out", default="bench/results/memory.json")
    p.add_argument("overrides", nargs="*", help="config overrides for the relayrl side, e.g. engine.dtype=float32")
    p.add_argument("--side", choices=["relayrl"], help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.quick:
        a.steps, a.no_trl = 1, True
    return a


def saved_activation_bytes(fn, *args):
    """Run fn(*args), counting the distinct storages autograd saves for backward (activations)."""
    import torch

    seen: dict[int, int] = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter) and t.device.type == "cpu":
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, sum(seen.values())


def children_rss_gb() -> float:
    total = 0
    for child in Path(f"/proc/{os.getpid()}/task").glob("*/children"):
        for pid in child.read_text().split():
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            total += next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS")), 0)
    return round(total / GB, 3)


def run_relayrl(a) -> dict:
    runtime = rss_bytes()
    sampler = PhaseSampler()
    import torch

    import relayrl.run.loop  # noqa: F401  - everything the CLI imports, before the runtime figure is taken
    from relayrl.common.memory import trim_memory
    from relayrl.config.schema import load_run_config
    from relayrl.run.build import build
    from relayrl.run.evaluator import rollout_metrics
    from relayrl.trainer.logprobs import working_bytes

    runtime = max(runtime, rss_bytes())
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as tmp:
        over = [*a.overrides, f"run.output_dir={tmp}", "run.tensorboard=false", "eval.at_start=false",
                "eval.at_end=false", f"run.steps={a.steps}", "run.print_samples=0"]
        cfg = load_run_config(a.config, over)
        c = build(cfg)
        engine = c.train_ctl.engine
        act = {"bytes": 0}
        plain_micro = engine._micro_step

        def micro_step(mb, *rest):  # the activations of each micro-batch, counted while it trains
            out, n = saved_activation_bytes(plain_micro, mb, *rest)
            act["bytes"] = max(act["bytes"], n)
            return out

        engine._micro_step = micro_step
        kv = 0
        try:
            for step in range(1, a.steps + 1):
                sampler.phase = "rollout"
                batch, m = c.rollouts.next_batch(c.train_ctl.version)
                m |= rollout_metrics(batch)
                kv = max(kv, sum(e.cache.nbytes() for e in c.rollout_ctl.engines if hasattr(e, "cache")))
                sampler.phase = "train"
                c.rollouts.release_memory()
                m |= c.train_ctl.fit(batch)
                sampler.phase = "weight_sync"
                c.rollouts.load_weights(c.train_ctl.weights())
                trim_memory()
                print(f"step {step}: rss {rss_bytes() / GB:.2f} GB, rollout {m['time/rollout_s']:.1f}s, "
                      f"train {m['time/train_s']:.1f}s", file=sys.stderr)
            judge_rss = children_rss_gb()
        finally:
            c.close()
    peaks = sampler.stop()
    params = list(engine.model.parameters())
    trainable = [p for p in params if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    opt = sum(t.numel() * t.element_size() for s in engine.optimizer.state.values() for t in s.values()
              if torch.is_tensor(t))
    engines = [e for e in c.rollout_ctl.engines if hasattr(e, "owns_weights")]
    engine_w = sum(p.numel() * p.element_size() for e in engines if e.owns_weights for p in e.model.parameters())
    vocab = engine.model.get_output_embeddings().weight.shape[0]
    parts = {"runtime": runtime, "weights": sum(p.numel() * p.element_size() for p in params),
             "grads": sum(p.numel() * 4 for p in trainable), "optimizer": opt, "engine_weights": engine_w,
             "kv_cache": kv, "activations": act["bytes"], "logits": working_bytes(vocab)}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    floor = 16 * n_params
    return {"peak_rss_gb": round(peak / GB, 3), "floor_gb": round(floor / GB, 3),
            "peak_over_floor": round(peak / floor, 2), "params": n_params,
            "parts_gb": {k: round(v / GB, 3) for k, v in parts.items()}, "phase_peak_rss_gb": peaks,
            "judge_workers_rss_gb": judge_rss,
            "settings": {"engine_dtype": c.cfg.engine.dtype, "autocast_bf16": c.cfg.model.autocast_bf16,
                         "shared_weights": engine_w == 0 and bool(engines),
                         "micro_batch_tokens": c.cfg.train.micro_batch_tokens,
                         "gradient_checkpointing": c.cfg.model.gradient_checkpointing}}


def trl_side(side: str, steps: int) -> dict:
    """TRL GRPOTrainer's peak RSS on the README job's settings (bench/grpo_step_vs_trl.py's defaults)."""
    from relayrl.models import resolve_model_path

    script = str(Path(__file__).with_name("grpo_step_vs_trl.py"))
    res = _common.run_child(script, ["--side", side, "--steps", str(steps), "--model", resolve_model_path("smollm2")],
                            f"grpo_step_vs_trl.py --side {side}")
    return {"peak_rss_gb": res["peak_rss_gb"], "settings": res["settings"]}


def parts(argv: list[str]) -> None:
    """Peak memory of the README's main job, part by part, and TRL GRPOTrainer's on the same settings.

    relayrl side: the run is built from examples/arithmetic_grpo.yaml (the README job) and stepped exactly as
    relayrl.run.loop.train_steps steps it, while a thread samples this process's RSS every 5 ms and keeps the peak
    of each phase (build, rollout, train, weight sync). The parts are counted from the objects themselves:
    trainer weights, gradients and AdamW state (fp32: 4 + 4 + 8 bytes/param, the 16 bytes/param floor), the
    engine's own weights (0 when it shares the trainer's), its KV cache at the end of a rollout, the LM-head
    chunk, and activations: the bytes autograd saved for backward in the largest micro-batch (a saved-tensors
    hook). `runtime` is the RSS of the interpreter with torch and transformers imported, before any model.
    `peak_rss_gb` is the process's own high-water mark (getrusage); judge workers are separate processes and are
    reported beside it (`judge_workers_rss_gb`).

    TRL side: bench/grpo_step_vs_trl.py's TRL subprocess (same model, prompts, group size, lengths, learning rate)
    reports its own getrusage peak.

        .venv/bin/python bench/memory.py parts             # README job, 3 steps, + TRL (fp32 and bf16)
        .venv/bin/python bench/memory.py parts --no-trl    # relayrl only
        .venv/bin/python bench/memory.py parts --quick     # smoke run on the tiny random model
    """
    a = parts_args(argv)
    if a.side:
        _common.write_json(a.result_file, run_relayrl(a))
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    overrides = list(a.overrides)
    if a.quick:
        from relayrl.models import tiny_model

        overrides.append(f"model.path={tiny_model()}")
    load = _common.load_before_run()
    res = {**_common.result_header("memory"), "load_before": load, "config": a.config, "overrides": a.overrides,
           "steps": a.steps}
    res["relayrl"] = _common.run_child(__file__, ["parts", "--side", "relayrl", "--config", a.config, "--steps",
                                                  str(a.steps), *overrides], "memory.py parts --side relayrl")
    if not a.no_trl:
        res["trl"] = trl_side("trl", a.steps)
        res["trl_bf16"] = trl_side("trl_bf16", a.steps)
        res["trl_vs_relayrl_peak"] = round(res["trl"]["peak_rss_gb"] / res["relayrl"]["peak_rss_gb"], 2)
    print(json.dumps(res, indent=2))
    if not a.quick:
        _common.write_json(a.out, res)


# ---- memory_phases ---------------------------------------------------------------------------------------------
def phases_args(argv: list[str]) -> argparse.Namespace:
    p = _common.parser("memory_phases", memory_phases.__doc__)
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
    phase(c.rollouts, "load_weights", "weight_sync")
    phase(c.rollouts, "evaluate", lambda: "eval_start" if step["n"] == 0 else "eval")
    phase(c, "save_model", "final_save")


def run_job(a) -> dict:
    engines: list = []
    sampler = Sampler(lambda: sum(e.cache.nbytes() for e in engines if hasattr(e, "cache")))
    from relayrl.config.schema import load_run_config
    from relayrl.run.build import build
    from relayrl.run.loop import train_steps

    with tempfile.TemporaryDirectory(prefix="bench_phases_") as tmp:
        over = [*a.overrides, f"run.output_dir={tmp}", f"run.steps={a.steps}", f"eval.every={a.eval_every}",
                "eval.at_start=true", "eval.at_end=true", "run.save_final=true", "run.print_samples=0"]
        cfg = load_run_config(a.config, over)
        sampler.set("build")
        c = build(cfg)
        engines += c.rollout_ctl.engines
        instrument(c, sampler)
        try:
            metrics = train_steps(c)
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


def memory_phases(argv: list[str]) -> None:
    """Peak memory of the README's whole job, phase by phase: where the job's high-water mark comes from.

    `bench/memory.py parts` steps the training loop alone; this runs the whole job the way `relayrl train` does
    (relayrl.run.loop.train_steps on examples/arithmetic_grpo.yaml: build, eval at start, rollout, train,
    weight sync, eval, final save, close) in a child process, while a thread samples RSS every 2 ms and keeps, per
    phase, the peak of the trainer process itself and, separately, the summed RSS of its child processes (the judge
    workers: separate processes, never part of `peak_rss_gb`). It also keeps the engines' KV cache bytes per phase.

    `peak_rss_gb` is the trainer process's own high-water mark (VmHWM), the figure `bench/learning.py readme_job`
    reports for the whole job (getrusage RUSAGE_CHILDREN's ru_maxrss: the largest single descendant, not a sum).

        .venv/bin/python bench/memory.py memory_phases                 # README job, 2 steps, eval every step
        .venv/bin/python bench/memory.py memory_phases --steps 3 engine.kv_cache_gb=0.1
        .venv/bin/python bench/memory.py memory_phases --quick         # smoke run on the tiny random model
    """
    a = phases_args(argv)
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
    res |= _common.run_child(__file__, ["memory_phases", "--config", a.config, "--steps", str(a.steps),
                                        "--eval-every", str(a.eval_every), *overrides], "the job")
    print(json.dumps(res, indent=2))
    if not a.quick:
        _common.write_json(a.out, res)


COMMANDS = {"parts": parts, "memory_phases": memory_phases, "step_memory": step_memory,
            "train_memory_trace": train_memory_trace, "backward_peak": backward_peak}

if __name__ == "__main__":  # judge workers are spawned: they re-import this file and must not run it
    _common.dispatch(__doc__, COMMANDS)
