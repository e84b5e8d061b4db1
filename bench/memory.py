#!/usr/bin/env python
"""Peak memory of the README's main job, part by part, and TRL GRPOTrainer's on the same settings.

relayrl side: the run is built from examples/arithmetic_grpo.yaml (the README job) and stepped exactly as
relayrl.run.loop.train_colocated steps it, while a thread samples this process's RSS every 5 ms and keeps the peak
of each phase (build, rollout, train, weight sync). The parts are counted from the objects themselves:
trainer weights, gradients and AdamW state (fp32: 4 + 4 + 8 bytes/param, the 16 bytes/param floor), the
engine's own weights (0 when it shares the trainer's), its KV cache at the end of a rollout, the LM-head
chunk, and activations: the bytes autograd saved for backward in the largest micro-batch (a saved-tensors
hook). `runtime` is the RSS of the interpreter with torch and transformers imported, before any model.
`peak_rss_gb` is the process's own high-water mark (getrusage); judge workers are separate processes and are
reported beside it (`judge_workers_rss_gb`).

TRL side: bench/grpo_step_vs_trl.py's TRL subprocess (same model, prompts, group size, lengths, learning rate)
reports its own getrusage peak.

    .venv/bin/python bench/memory.py                 # README job, 3 steps, + TRL (fp32 and bf16)
    .venv/bin/python bench/memory.py --no-trl        # relayrl only
    .venv/bin/python bench/memory.py --quick         # smoke run on the tiny random model
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

GB = 1e9


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PhaseSampler:
    """Samples RSS on a thread and keeps the peak per phase (the phase is whatever `phase` was last set to)."""

    def __init__(self, interval: float = 0.005):
        self.phase, self.peaks, self.interval = "startup", {}, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = rss_bytes()
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), rss)
            time.sleep(self.interval)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        return {k: round(v / GB, 3) for k, v in self.peaks.items()}


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
    from relayrl.common.utils import trim_memory
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
                c.rollouts.push_weights(c.train_ctl)
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


def child(extra: list[str], script: str = __file__) -> dict:
    return _common.run_child(script, extra, f"{Path(script).name} {' '.join(extra[:2])}")


def trl_side(side: str, steps: int) -> dict:
    """TRL GRPOTrainer's peak RSS on the README job's settings (bench/grpo_step_vs_trl.py's defaults)."""
    from relayrl.models import resolve_model_path

    res = child(["--side", side, "--steps", str(steps), "--model", resolve_model_path("smollm2")],
                script=str(Path(__file__).with_name("grpo_step_vs_trl.py")))
    return {"peak_rss_gb": res["peak_rss_gb"], "settings": res["settings"]}


def main() -> None:
    a = parse_args()
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
    res["relayrl"] = child(["--side", "relayrl", "--config", a.config, "--steps", str(a.steps), *overrides])
    if not a.no_trl:
        res["trl"] = trl_side("trl", a.steps)
        res["trl_bf16"] = trl_side("trl_bf16", a.steps)
        res["trl_vs_relayrl_peak"] = round(res["trl"]["peak_rss_gb"] / res["relayrl"]["peak_rss_gb"], 2)
    print(json.dumps(res, indent=2))
    if not a.quick:
        _common.write_json(a.out, res)


if __name__ == "__main__":
    main()
