#!/usr/bin/env python
"""Where one training fit's time goes: its matmuls' arithmetic rate against this machine's, and the rest by kind.

Why: the train phase is most of relayrl's GRPO step (docs/benchmarks.md, "Speed: one GRPO step"). This builds the
README job (examples/arithmetic_grpo.yaml plus overrides), rolls out one batch, fits it once plainly (timed), again
under torch.profiler, and a third time to count the matmuls' FLOPs (counting slows the small ops); groups the
profiled fit's self times (matmuls, attention, casts and copies, elementwise and the rest) and sets the matmuls'
FLOPs against this machine's matmul rate at a training shape (bench/matmul_isa.measure): the fit's floor at these
settings is the matmul FLOPs at that rate.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/fit_profile.py sampling.max_new_tokens=128   # the GRPO bench's lengths
    HF_HUB_OFFLINE=1 .venv/bin/python bench/fit_profile.py --out /tmp/p.json model.gradient_checkpointing=false
    .venv/bin/python bench/fit_profile.py --quick          # smoke run on the tiny random model (seconds)
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections import defaultdict

import _common
import matmul_isa

PEAK_SHAPE = (1024, 576, 1536)  # [rows x in] @ [in x out]: an MLP up-projection of SmolLM2-135M in training
MATMUL = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}
ATTENTION = ("_SegmentKernel", "_SegmentKernelBackward", "aten::_scaled_dot_product", "aten::scaled_dot_product")
COPIES = {"aten::copy_", "aten::_to_copy", "aten::clone", "aten::contiguous", "aten::index_select", "aten::cat"}
ELEMENTWISE = {"aten::mul", "aten::mul_", "aten::add", "aten::add_", "aten::sub", "aten::sub_", "aten::div",
               "aten::neg", "aten::pow", "aten::rsqrt", "aten::mean", "aten::sum", "aten::silu", "aten::silu_backward",
               "aten::exp", "aten::exp_", "aten::fill_", "aten::zero_", "aten::amax", "aten::log", "aten::where"}


def category(name: str) -> str:
    if name in MATMUL:
        return "matmul"
    if name.startswith(ATTENTION):
        return "attention"
    if name in COPIES:
        return "casts_copies"
    if name in ELEMENTWISE:
        return "elementwise"
    if name.startswith("Optimizer.step"):
        return "optimizer"
    return "other"


def profile_fit(overrides: list[str]) -> dict:
    from torch.profiler import ProfilerActivity, profile

    import relayrl.run.loop  # noqa: F401 - everything the CLI imports
    from relayrl.common.utils import trim_memory, tune_allocator
    from relayrl.config.schema import load_run_config
    from relayrl.run.build import build

    tune_allocator()
    with tempfile.TemporaryDirectory(prefix="bench_fit_profile_") as tmp:
        cfg = load_run_config("examples/arithmetic_grpo.yaml",
                              [f"run.output_dir={tmp}", "run.tensorboard=false", "eval.at_start=false",
                               "eval.at_end=false", "run.print_samples=0", *overrides])
        c = build(cfg)
        try:
            batch, _ = c.rollouts.next_batch(c.train_ctl.version)
            c.rollouts.release_memory()
            trim_memory()
            t0 = time.perf_counter()
            metrics = c.train_ctl.fit(batch)
            plain_s = time.perf_counter() - t0
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t0 = time.perf_counter()
                c.train_ctl.fit(batch)
                profiled_s = time.perf_counter() - t0
            with profile(activities=[ProfilerActivity.CPU], with_flops=True) as counted:  # FLOP counting costs time
                c.train_ctl.fit(batch)
            settings = {"autocast_bf16": c.train_ctl.engine.autocast_bf16,
                        "gradient_checkpointing": cfg.model.gradient_checkpointing,
                        "micro_batch_tokens": cfg.train.micro_batch_tokens,
                        "max_new_tokens": cfg.sampling.max_new_tokens,
                        "trained_tokens": int(metrics.get("train/tokens", 0)), "samples": len(batch)}
        finally:
            c.close()
    by_cat, ops = defaultdict(float), []
    for e in prof.key_averages():
        s = e.self_cpu_time_total / 1e6
        by_cat[category(e.key)] += s
        ops.append((s, e.key, e.count))
    flops = sum(e.flops or 0 for e in counted.key_averages() if e.key in MATMUL)
    mm_s = by_cat["matmul"]
    peak = matmul_isa.measure("bfloat16" if settings["autocast_bf16"] else "float32", repeats=7,
                              shapes=[PEAK_SHAPE])[0]["gflops"]
    total = sum(by_cat.values())
    return {"settings": settings, "overrides": overrides, "fit_s": round(plain_s, 2),
            "profiled_fit_s": round(profiled_s, 2), "self_s_total": round(total, 2),
            "self_s": {k: round(v, 2) for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
            "self_share": {k: round(v / total, 3) for k, v in by_cat.items()},
            "matmul_gflop": round(flops / 1e9, 3), "matmul_gflops_in_fit": round(flops / mm_s / 1e9, 1),
            "matmul_gflops_alone": round(peak, 1), "floor_s_matmuls_at_rate_alone": round(flops / peak / 1e9, 2),
            "top_ops": [{"op": k, "self_s": round(s, 3), "calls": n} for s, k, n in sorted(ops, reverse=True)[:25]]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="default bench/results/fit_profile.json (--quick: a temp file)")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny model in fp32, 2x2, 10 new tokens")
    p.add_argument("overrides", nargs="*", help="config overrides on examples/arithmetic_grpo.yaml")
    a = p.parse_args()
    if a.quick:
        from relayrl.models import tiny_model

        a.overrides = [f"model.path={tiny_model()}", "engine.dtype=float32", "model.autocast_bf16=false",
                       "data.batch_size=2", "data.group_size=2", "sampling.max_new_tokens=10", *a.overrides]
    a.out = a.out or (os.path.join(tempfile.gettempdir(), "fit_profile_quick.json") if a.quick
                      else "bench/results/fit_profile.json")
    out = _common.result_header("fit_profile") | {"load_1min_at_start": _common.load_before_run()}
    out |= profile_fit(a.overrides)
    _common.write_json(a.out, out)
    print({k: out[k] for k in ("fit_s", "self_s", "matmul_gflops_in_fit", "matmul_gflops_alone",
                               "floor_s_matmuls_at_rate_alone")})


if __name__ == "__main__":
    main()
