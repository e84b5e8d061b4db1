"""fp32 and bf16 matmul speed at the README job's shapes, at the native ISA and as AVX2, side by side.

Why: the README job's step time on a CPU is mostly fp32 matmuls, and `--cpu avx2` (bench/readme_job.py) imitates
an AVX2-only CPU by restricting ATen's and oneDNN's kernels. This shows what that restriction does to the
matmuls themselves (MKL's fp32 sgemm is not restricted by it) and how far bf16 is from fp32 on this machine.
Each ISA setting runs in its own subprocess (the switches are read when torch loads); median of 5 timed calls.

    .venv/bin/python bench/matmul_isa.py      # ~1 minute; writes bench/results/matmul_isa.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import _common

# [rows x in] @ [in x out] of SmolLM2-135M in training: MLP up/down, attention projection, a decode step, LM head
SHAPES = [(2048, 576, 1536), (2048, 1536, 576), (2048, 576, 576), (64, 576, 1536), (2048, 576, 49152)]


def measure(dtype_name: str, repeats: int = 5, shapes=SHAPES) -> list[dict]:
    """GFLOP/s per shape (default: SHAPES) in this process (torch's default threads)."""
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


def run_side(isa: str, dtypes: list[str]) -> dict:
    env = {**os.environ, **(_common.AVX2_ENV if isa == "avx2" else {})}
    code = (f"import sys, json; sys.path.insert(0, {str(_common.REPO / 'bench')!r}); import torch, matmul_isa; "
            f"print(json.dumps({{'capability': torch.backends.cpu.get_cpu_capability(), "
            f"**{{d: matmul_isa.measure(d) for d in {dtypes!r}}}}}))")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--out", default=str(_common.REPO / "bench/results/matmul_isa.json"))
    a = p.parse_args(argv)
    res = _common.result_header("matmul_isa") | {"load_before": _common.load_before_run()}
    dtypes = a.dtypes.split(",")
    res["sides"] = {isa: run_side(isa, dtypes) for isa in ("native", "avx2")}
    for isa, side in res["sides"].items():
        for d in dtypes:
            med = statistics.median(r["gflops"] for r in side[d])
            print(f"{isa:6s} ({side['capability']}) {d:8s} median over shapes {med:7.1f} GFLOP/s: "
                  + ", ".join(f"{r['gflops']:.0f}" for r in side[d]))
    _common.write_json(a.out, res)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
