#!/usr/bin/env python
"""What building the C kernels without -ffast-math costs: each kernel built with its previous flags
(`-O3 -march=native -ffast-math -fopenmp` for the four that call expf or divide, `PREVIOUS` for the others) and
with relayrl.common.cbuild.CFLAGS, timed side by side.

Why: -ffast-math let gcc use reciprocal estimates whose error differs by ISA, so a kernel computed different numbers
on an AVX-512 Xeon than on the Zen 4 it was tested on (relayrl/common/cbuild.py). CFLAGS keeps reassociation and
libmvec's expf, drops the estimates; this measures what that costs at the shapes the trainer and engine run
(SmolLM2-135M). The two builds alternate within each repetition (the host's speed drifts); the median of the
repetitions is reported, and the ratio previous / current (above 1: the current build is faster).

    .venv/bin/python bench/kernel_math.py --out bench/results/kernel_math.json
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python bench/kernel_math.py   # both built as AVX2
"""

from __future__ import annotations

import argparse
import statistics
import time

import _common
import decode_attention as decode_bench
import segment_attention as segment_bench
import train_kernels

FAST_MATH = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
# each kernel's flags before CFLAGS: the four that call expf or divide were built with -ffast-math
PREVIOUS = {"skinny_linear": ["-O3", "-march=native", "-fopenmp"],
            "adamw_bf16": ["-O3", "-march=native", "-fno-math-errno", "-fopenmp"]}


def builds(module, name: str) -> dict:
    """{"previous": the kernel built with its flags before CFLAGS, "current": with CFLAGS}, each with the module's
    signatures."""
    from relayrl.common import cbuild

    libs = {"previous": cbuild.load(module._SOURCE, signatures={}, fallback="-", cflags=PREVIOUS.get(name, FAST_MATH)),
            "current": module.load_kernel()}
    if any(lib is None for lib in libs.values()):
        raise SystemExit(f"error: {name} did not build")
    # the current build has the module's signatures declared: the previous one gets the same
    for fn in dir(libs["current"]):
        if fn.startswith("relayrl_"):
            src, dst = getattr(libs["current"], fn), getattr(libs["previous"], fn)
            dst.argtypes, dst.restype = src.argtypes, src.restype
    return libs


def medians(fs: dict, reps: int) -> dict:
    """Median seconds of each variant's call, the variants interleaved in each repetition after a warm-up."""
    times: dict = {k: [] for k in fs}
    for rep in range(reps + 1):
        for name, f in fs.items():
            t0 = time.perf_counter()
            f()
            if rep:
                times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def ratio_row(t: dict) -> dict:
    return {f"{k}_ms": 1e3 * v for k, v in t.items()} | {"previous_over_current": t["previous"] / t["current"]}


def norm_swiglu(reps: int, tokens: int = 700) -> dict:
    """The trainer's RMSNorm (576) and SwiGLU (1536) forward + backward at a 700-token micro-batch."""
    from relayrl.models import fused

    libs, out = builds(fused, "norm_swiglu"), {}
    for op, fn, shapes in (("rms_norm", lambda x, w: fused.rms_norm(x, w, 1e-6), ((tokens, 576), (576,))),
                           ("swiglu", fused.swiglu, ((tokens, 1536), (tokens, 1536)))):
        run = train_kernels.fwd_bwd(fn, *shapes)

        def with_lib(lib, run=run):
            fused.load_kernel = lambda: lib  # what the autograd functions call
            run()
        original = fused.load_kernel
        try:
            out[op] = ratio_row(medians({k: (lambda lib=lib: with_lib(lib)) for k, lib in libs.items()}, reps))
        finally:
            fused.load_kernel = original
    return out


def decode_ops(reps: int, rows: int = 16) -> dict:
    """The engine's decode step: residual add + RMSNorm over 576, rows x 30 layers x 2 norms."""
    import torch

    from relayrl.engine import direct

    libs = builds(direct, "decode_ops")
    h, d, w, y = torch.randn(rows, 576), torch.randn(rows, 576), torch.randn(576), torch.empty(rows, 576)

    def step(lib):
        for _ in range(60):
            lib.relayrl_add_rms_norm(rows, 576, h.data_ptr(), d.data_ptr(), w.data_ptr(), 1e-5, y.data_ptr(), 2)
    return {"add_rms_norm_x60": ratio_row(medians({k: (lambda lib=lib: step(lib)) for k, lib in libs.items()},
                                                  reps))}


def skinny_linear(reps: int) -> dict:
    """The engine's few-row linears: 16 rows through SmolLM2's gate/up (576 -> 1536) and down (1536 -> 576)."""
    import torch

    from relayrl.engine import skinny

    libs = builds(skinny, "skinny_linear")
    x, xd = torch.randn(16, 576), torch.randn(16, 1536)
    w1, w2 = torch.randn(1536, 576), torch.randn(576, 1536)

    def layer(lib):
        for _ in range(10):
            skinny.skinny_linear(lib, x, w1, None)
            skinny.skinny_linear(lib, xd, w2, None)
    return {"mlp_linears_x10": ratio_row(medians({k: (lambda lib=lib: layer(lib)) for k, lib in libs.items()},
                                                 reps))}


def adamw(reps: int, n: int = 1 << 22) -> dict:
    """One AdamW step over 4M fp32 weights with bf16 moments (the kernel's common call)."""
    import torch

    from relayrl.trainer import optim

    libs = builds(optim, "adamw_bf16")
    w, g = torch.randn(n), torch.randn(n)
    m, v = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)

    def step(lib):
        lib.relayrl_adamw_bf16(n, w.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), 1e-6, 0.9, 0.999, 1e-8,
                               0.0, 1e-6, 1.0, 1, torch.get_num_threads())
    return {"step_4M": ratio_row(medians({k: (lambda lib=lib: step(lib)) for k, lib in libs.items()}, reps))}


def attention(reps: int) -> dict:
    """Decode attention (30 layers, 16 rows, 512 context) and shared-prompt attention (a 2-row micro-batch)."""
    import torch

    from relayrl.engine import attention as decode
    from relayrl.models import segments

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        case = decode_bench.measure(builds(decode, "decode_attention"), 512, 16, dtype, reps)
        out[f"decode_{case['kv_dtype']}"] = {k: case[k] for k in ("previous_ms", "current_ms")} | {
            "previous_over_current": case["previous_ms"] / case["current_ms"]}
    case = segment_bench.measure(builds(segments, "segment_attention"), 2, 8, 4, reps)
    for part in ("fwd", "bwd"):
        out[f"segment_{part}"] = {f"{k}_ms": case[f"{k}_{part}_ms"] for k in ("previous", "current")} | {
            "previous_over_current": case[f"previous_{part}_ms"] / case[f"current_{part}_ms"]}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--out", default="bench/results/kernel_math.json")
    a = p.parse_args()
    train_kernels.keep_heap()
    load = _common.load_before_run()
    result = {"machine": _common.machine_info(), "load_before": load, "reps": a.reps,
              "previous_flags": {"default": FAST_MATH, **PREVIOUS}}
    for name, fn in (("norm_swiglu", norm_swiglu), ("decode_ops", decode_ops), ("skinny_linear", skinny_linear),
                     ("adamw_bf16", adamw), ("attention", attention)):
        result[name] = fn(a.reps)
        print(name, {k: round(v["previous_over_current"], 3) for k, v in result[name].items()}, flush=True)
    _common.write_json(a.out, result)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
