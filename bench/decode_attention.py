#!/usr/bin/env python
"""The C decode-attention kernel alone, per decode step: fp32 and bf16 KV caches, optionally against another build of
the kernel (e.g. the previous commit's source) in the same process, alternating.

Why: a decode step's attention reads every running sequence's keys and values once per layer, so at long contexts
it is a large part of the step, and the engine's step times on a shared 2-core host move by +-15% from run to run;
timing the kernel alone over 30 layers' distinct caches (more than any cache level), min of --reps passes, side by
side, says what a kernel change or the cache's dtype does.

    .venv/bin/python bench/decode_attention.py                                 # this checkout's kernel
    git show HEAD~1:relayrl/engine/kernels/decode_attention.c > /tmp/old.c
    .venv/bin/python bench/decode_attention.py --baseline-source /tmp/old.c --out bench/results/decode_attention.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import _common

SHAPE = {"layers": 30, "kv_heads": 3, "group": 3, "head_dim": 64}  # SmolLM2-135M's attention


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="100,1000", help="positions attended per sequence")
    p.add_argument("--rows", default="32,64", help="sequences decoded together")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--baseline-source", help="another decode_attention.c to build and time beside this one")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def measure(libs: dict, context: int, rows: int, dtype, reps: int) -> dict:
    """Min seconds of one decode step's attention (all layers) per build."""
    import torch

    from relayrl.engine import attention

    kvh, g, d = SHAPE["kv_heads"], SHAPE["group"], SHAPE["head_dim"]
    caches = [(torch.randn(rows, kvh, context + 64, d).to(dtype), torch.randn(rows, kvh, context + 64, d).to(dtype))
              for _ in range(SHAPE["layers"])]
    q, k, v = torch.randn(rows, kvh * g, 1, d), torch.randn(rows, kvh, 1, d), torch.randn(rows, kvh, 1, d)
    pos = torch.full((rows,), context, dtype=torch.int64)
    best = {name: float("inf") for name in libs}
    for rep in range(reps + 1):
        for name, lib in libs.items():
            t0 = time.perf_counter()
            for kc, vc in caches:
                attention.decode_attention(lib, q, k, v, kc, vc, pos, d ** -0.5)
            if rep:  # the first pass warms up
                best[name] = min(best[name], time.perf_counter() - t0)
    kv_gb = sum(2 * kc[:, :, : context + 1].numel() * kc.element_size() for kc, _ in caches) / 1e9
    return {"context": context, "rows": rows, "kv_dtype": str(dtype).removeprefix("torch."), "kv_read_gb": kv_gb,
            **{f"{name}_ms": 1e3 * s for name, s in best.items()},
            **{f"{name}_gb_per_s": kv_gb / s for name, s in best.items()}}


def main() -> None:
    a = parse_args()
    import torch

    from relayrl.engine import attention

    # built as the engine builds it (relayrl.common.cbuild: its flags, its ISA, its cache); a baseline source must
    # define every variant this one does (relayrl_decode_attention_f32_bf16kv: since 8e1d458)
    libs = _common.kernel_builds(attention.load_kernel(), attention.build, a.baseline_source)
    cases = []
    for context in map(int, a.contexts.split(",")):
        for rows in map(int, a.rows.split(",")):
            for dtype in (torch.float32, torch.bfloat16):
                c = measure(libs, context, rows, dtype, a.reps)
                if "baseline_ms" in c:
                    c["kernel_vs_baseline_time"] = c["kernel_ms"] / c["baseline_ms"]
                print({k: round(v, 3) if isinstance(v, float) else v for k, v in c.items()}, file=sys.stderr)
                cases.append(c)
    res = {**_common.result_header("decode_attention"), "shape": SHAPE, "reps": a.reps,
           "baseline_source": a.baseline_source, "cases": cases}
    print(json.dumps(res, indent=2))
    if a.out:
        _common.write_json(a.out, res)


if __name__ == "__main__":
    sys.exit(main())
