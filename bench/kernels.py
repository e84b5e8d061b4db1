#!/usr/bin/env python
"""The C kernels and the matmuls under them, each alone at SmolLM2-135M's shapes: `bench/kernels.py COMMAND`.

Each command times its variants side by side in one process (or one subprocess per ISA setting), in turn within
each repetition, because the host's speed drifts; `bench/kernels.py COMMAND --help` gives its options, and its
docstring (below, and in bench/_kernels_engine.py and bench/_kernels_train.py) says what it measures and how.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import _common
from _kernels_engine import decode_attention, decode_measure, engine_linear, skinny_rows
from _kernels_train import fwd_bwd, keep_heap, optim_step, segment_attention, segment_measure, train_kernels

# [rows x in] @ [in x out] of SmolLM2-135M in training: MLP up/down, attention projection, a decode step, LM head
MATMUL_SHAPES = [(2048, 576, 1536), (2048, 1536, 576), (2048, 576, 576), (64, 576, 1536), (2048, 576, 49152)]
FAST_MATH = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
# each kernel's flags before CFLAGS: the four that call expf or divide were built with -ffast-math
PREVIOUS = {"skinny_linear": ["-O3", "-march=native", "-fopenmp"],
            "adamw_bf16": ["-O3", "-march=native", "-fno-math-errno", "-fopenmp"]}


# ---- matmul_isa ------------------------------------------------------------------------------------------------
def matmul_measure(dtype_name: str, repeats: int = 5, shapes=MATMUL_SHAPES) -> list[dict]:
    """GFLOP/s per shape (default: MATMUL_SHAPES) in this process (torch's default threads)."""
    import torch

    dtype = getattr(torch, dtype_name)
    out = []
    for m, k, n in shapes:
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
        a @ b.t()  # warm-up: first-call dispatch and packing
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            a @ b.t()
            times.append(time.perf_counter() - t)
        out.append({"shape": [m, k, n], "gflops": 2 * m * k * n / statistics.median(times) / 1e9})
    return out


def matmul_side(isa: str, dtypes: list[str]) -> dict:
    env = {**os.environ, **(_common.AVX2_ENV if isa == "avx2" else {})}
    code = (f"import sys, json; sys.path.insert(0, {str(_common.REPO / 'bench')!r}); import torch, kernels; "
            f"print(json.dumps({{'capability': torch.backends.cpu.get_cpu_capability(), "
            f"**{{d: kernels.matmul_measure(d) for d in {dtypes!r}}}}}))")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def matmul_isa(argv: list[str]) -> None:
    """fp32 and bf16 matmul speed at the README job's shapes, at the native ISA and as AVX2, side by side.

    Why: the README job's step time on a CPU is mostly fp32 matmuls, and `--cpu avx2` (bench/learning.py readme_job)
    imitates an AVX2-only CPU by restricting ATen's and oneDNN's kernels. This shows what that restriction does to
    the matmuls themselves (MKL's fp32 sgemm is not restricted by it) and how far bf16 is from fp32 on this machine.
    Each ISA setting runs in its own subprocess (the switches are read when torch loads); median of 5 timed calls.

        .venv/bin/python bench/kernels.py matmul_isa   # ~1 minute; writes bench/results/matmul_isa.json
    """
    p = _common.parser("matmul_isa", matmul_isa.__doc__)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--out", default=str(_common.REPO / "bench/results/matmul_isa.json"))
    a = p.parse_args(argv)
    res = _common.result_header("matmul_isa") | {"load_before": _common.load_before_run()}
    dtypes = a.dtypes.split(",")
    res["sides"] = {isa: matmul_side(isa, dtypes) for isa in ("native", "avx2")}
    for isa, side in res["sides"].items():
        for d in dtypes:
            med = statistics.median(r["gflops"] for r in side[d])
            print(f"{isa:6s} ({side['capability']}) {d:8s} median over shapes {med:7.1f} GFLOP/s: "
                  + ", ".join(f"{r['gflops']:.0f}" for r in side[d]))
    _common.write_json(a.out, res)
    print(f"wrote {a.out}")


# ---- kernel_math -----------------------------------------------------------------------------------------------
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


def math_norm_swiglu(reps: int, tokens: int = 700) -> dict:
    """The trainer's RMSNorm (576) and SwiGLU (1536) forward + backward at a 700-token micro-batch."""
    from relayrl.models import fused

    libs, out = builds(fused, "norm_swiglu"), {}
    for op, fn, shapes in (("rms_norm", lambda x, w: fused.rms_norm(x, w, 1e-6), ((tokens, 576), (576,))),
                           ("swiglu", fused.swiglu, ((tokens, 1536), (tokens, 1536)))):
        run = fwd_bwd(fn, *shapes)

        def with_lib(lib, run=run):
            fused.load_kernel = lambda: lib  # what the autograd functions call
            run()
        original = fused.load_kernel
        try:
            out[op] = ratio_row(medians({k: (lambda lib=lib: with_lib(lib)) for k, lib in libs.items()}, reps))
        finally:
            fused.load_kernel = original
    return out


def math_decode_ops(reps: int, rows: int = 16) -> dict:
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


def math_skinny_linear(reps: int) -> dict:
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


def math_adamw(reps: int, n: int = 1 << 22) -> dict:
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


def math_attention(reps: int) -> dict:
    """Decode attention (30 layers, 16 rows, 512 context) and shared-prompt attention (a 2-row micro-batch)."""
    import torch

    from relayrl.engine import attention as decode
    from relayrl.models import segments

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        case = decode_measure(builds(decode, "decode_attention"), 512, 16, dtype, reps)
        out[f"decode_{case['kv_dtype']}"] = {k: case[k] for k in ("previous_ms", "current_ms")} | {
            "previous_over_current": case["previous_ms"] / case["current_ms"]}
    case = segment_measure(builds(segments, "segment_attention"), 2, 8, 4, reps)
    for part in ("fwd", "bwd"):
        out[f"segment_{part}"] = {f"{k}_ms": case[f"{k}_{part}_ms"] for k in ("previous", "current")} | {
            "previous_over_current": case[f"previous_{part}_ms"] / case[f"current_{part}_ms"]}
    return out


def kernel_math(argv: list[str]) -> None:
    """What building the C kernels without -ffast-math costs: each kernel built with its previous flags
    (`-O3 -march=native -ffast-math -fopenmp` for the four that call expf or divide, `PREVIOUS` for the others) and
    with relayrl.common.cbuild.CFLAGS, timed side by side.

    Why: -ffast-math let gcc use reciprocal estimates whose error differs by ISA, so a kernel computed different
    numbers on an AVX-512 Xeon than on the Zen 4 it was tested on (relayrl/common/cbuild.py). CFLAGS keeps
    reassociation and libmvec's expf, drops the estimates; this measures what that costs at the shapes the trainer and
    engine run (SmolLM2-135M). The two builds alternate within each repetition (the host's speed drifts); the median
    of the repetitions is reported, and the ratio previous / current (above 1: the current build is faster).

        .venv/bin/python bench/kernels.py kernel_math --out bench/results/kernel_math.json
        ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python bench/kernels.py kernel_math   # as AVX2
    """
    p = _common.parser("kernel_math", kernel_math.__doc__)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--out", default="bench/results/kernel_math.json")
    a = p.parse_args(argv)
    keep_heap()
    load = _common.load_before_run()
    result = {"machine": _common.machine_info(), "load_before": load, "reps": a.reps,
              "previous_flags": {"default": FAST_MATH, **PREVIOUS}}
    for name, fn in (("norm_swiglu", math_norm_swiglu), ("decode_ops", math_decode_ops),
                     ("skinny_linear", math_skinny_linear), ("adamw_bf16", math_adamw), ("attention", math_attention)):
        result[name] = fn(a.reps)
        print(name, {k: round(v["previous_over_current"], 3) for k, v in result[name].items()}, flush=True)
    _common.write_json(a.out, result)
    print(f"wrote {a.out}")


COMMANDS = {"decode_attention": decode_attention, "segment_attention": segment_attention, "skinny_rows": skinny_rows,
            "train_kernels": train_kernels, "kernel_math": kernel_math, "optim_step": optim_step,
            "engine_linear": engine_linear, "matmul_isa": matmul_isa}

if __name__ == "__main__":
    _common.dispatch(__doc__, COMMANDS)
