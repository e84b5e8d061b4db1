#!/usr/bin/env python
"""A CPU engine's fp32 linears at 1-64 rows: PyTorch's F.linear against relayrl's few-row kernel
(relayrl/engine/kernels/skinny_linear.c), and optionally against another version of that kernel's source.

Why: a decode step multiplies as many rows as sequences are running by weights that do not fit in cache; this times
one pass over 30 layers' distinct weights of SmolLM2-135M's shapes (q, k, v, o, gate, up, down: 430 MB of fp32) at
each row count, every variant in turn within each repetition (the host's speed drifts), and keeps each variant's
fastest repetition. The engine's own row limit is what relayrl.engine.skinny measures once per machine; this shows
the whole curve.

    .venv/bin/python bench/skinny_rows.py --out bench/results/skinny_rows.json
    git show REV:relayrl/engine/kernels/skinny_linear.c > /tmp/skinny_linear_before.c
    .venv/bin/python bench/skinny_rows.py --also /tmp/skinny_linear_before.c    # a kernel version beside this one
    .venv/bin/python bench/skinny_rows.py --quick      # 2 layers, 3 row counts, seconds
"""

from __future__ import annotations

import argparse
from pathlib import Path

import _common

SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]  # [out, in]
ROWS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)


def variants(also: str | None) -> dict:
    """name -> f(x, w) for PyTorch's linear, this kernel and (`also`) another source of it (its row limit:
    whatever that source accepts; a refusal skips the row count)."""
    import torch.nn.functional as F

    from relayrl.common import cbuild
    from relayrl.engine import skinny

    out = {"pytorch": F.linear}
    kernels = {"kernel": skinny.load_kernel()}
    if also:
        # only the entry this bench calls: sources before the multi call (0a9ae4f) define no relayrl_skinny_multi_f32
        single = {k: v for k, v in skinny.SIGNATURES.items() if k == "relayrl_skinny_linear_f32"}
        kernels["kernel_also"] = cbuild.load(Path(also), signatures=single, fallback="not compared")
    for name, lib in kernels.items():
        if lib is None:
            raise SystemExit(f"{name}: the kernel did not build (see the warning above)")
        out[name] = lambda x, w, lib=lib: skinny.skinny_linear(lib, x, w, None)
    return out


def time_rows(fs: dict, layers: list, m: int, reps: int) -> dict:
    """Fastest of `reps` passes over every layer's weights at m rows, per variant (variants interleaved)."""
    import time

    import torch

    xs = {k: torch.randn(m, k) for k in {w.shape[1] for w in layers[0]}}
    best: dict = {}
    for rep in range(reps + 1):  # the first pass warms up
        for name, f in fs.items():
            try:
                t = time.perf_counter()
                for layer in layers:
                    for w in layer:
                        f(xs[w.shape[1]], w)
                dt = time.perf_counter() - t
            except RuntimeError:  # a row count that version refuses
                continue
            if rep:
                best[name] = min(best.get(name, dt), dt)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--also", help="another skinny_linear.c to time beside this one (e.g. an earlier revision)")
    p.add_argument("--reps", type=int, default=11)
    p.add_argument("--out", default=None, help="result file (default: print only)")
    p.add_argument("--quick", action="store_true", help="2 layers, 3 row counts, 2 repetitions")
    a = p.parse_args()
    import torch

    n_layers, rows, reps = (2, (1, 8, 64), 2) if a.quick else (30, ROWS, a.reps)
    torch.manual_seed(0)
    layers = [[torch.randn(n, k) / k**0.5 for n, k in SHAPES] for _ in range(n_layers)]
    flops_per_row = 2 * n_layers * sum(n * k for n, k in SHAPES)
    fs = variants(a.also)
    x = torch.randn(5, 576)
    for name, f in fs.items():  # every variant computes the same product before it is timed
        if not torch.allclose(f(x, layers[0][0]), x @ layers[0][0].T, rtol=1e-4, atol=1e-4):
            raise SystemExit(f"{name} disagrees with x @ w.T")
    table = []
    with torch.inference_mode():
        for m in rows:
            best = time_rows(fs, layers, m, reps)
            row = {"rows": m, **{f"{k}_ms": v * 1e3 for k, v in best.items()},
                   **{f"{k}_gflops": flops_per_row * m / v / 1e9 for k, v in best.items()}}
            for k in best:
                if k != "pytorch" and "pytorch" in best:
                    row[f"{k}_vs_pytorch"] = best["pytorch"] / best[k]
            if "kernel_also" in best:
                row["kernel_vs_also"] = best["kernel_also"] / best["kernel"]
            table.append(row)
            print({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    res = {**_common.result_header("skinny_rows"), "workload": {
        "layers": n_layers, "shapes_out_in": SHAPES, "weights_mb": flops_per_row / 2 * 4 / 1e6, "reps": reps,
        "threads": torch.get_num_threads(), "also": a.also}, "rows": table}
    if a.out:
        _common.write_json(a.out, res)


if __name__ == "__main__":
    main()
