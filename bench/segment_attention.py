#!/usr/bin/env python
"""The trainer's shared-prompt attention kernel alone (relayrl/models/kernels/segment_attention.c), forward and
backward, at the GRPO bench's shapes, optionally against another build of it (e.g. the previous commit's source)
in the same process, alternating.

Why: in the GRPO bench's fit (bench/fit_profile.py) this attention was the largest cost after the matmuls, and a
fit's time moves by +-10% from run to run on a shared host, so a kernel change is judged here, on the C calls alone:
SmolLM2-135M's heads (9 query heads over 3 KV heads of 64), one micro-batch of one or two rows [prompt, 8
responses] as the packer lays out a GRPO group (relayrl.trainer.packer), the 30 layers' calls of a fit's micro-batch
in one pass; the median of --reps passes per build and FLOP rates (forward 4 D and backward 10 D per visible
(query head, key) pair: scores, probabilities times values; and again scores, dout . v, dq, dk, dv).

    .venv/bin/python bench/segment_attention.py                              # this checkout's kernel
    git show HEAD~1:relayrl/models/kernels/segment_attention.c > /tmp/old.c
    .venv/bin/python bench/segment_attention.py --baseline-source /tmp/old.c --out bench/results/segment_attention.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import _common

SHAPE = {"layers": 30, "heads": 9, "kv_heads": 3, "head_dim": 64}  # SmolLM2-135M's attention
LENGTHS = (20, 30, 40, 50, 60, 128)  # response lengths drawn per row: the GRPO bench's spread up to its 128 cap


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,2", help="rows per micro-batch (a 1024-token budget holds one or two)")
    p.add_argument("--group", type=int, default=8, help="responses per row")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--baseline-source", help="another segment_attention.c to build and time beside this one")
    p.add_argument("--quick", action="store_true", help="3 layers, 2 passes: a smoke run")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def micro_batch(rows: int, group: int, seed: int):
    """A seeded layout of `rows` rows [prompt, group responses], and its visible (query head, key) pairs."""
    from relayrl.models.segments import segment_layout

    rng = random.Random(seed)
    prompt_lens, spans, width, pairs = [], [], 0, 0
    for _ in range(rows):
        p = rng.randint(25, 35)
        start, row = p, []
        pairs += p * (p + 1) // 2
        for _ in range(group):
            n = rng.choice(LENGTHS)
            row.append((start, n))
            pairs += n * p + n * (n + 1) // 2
            start += n
        prompt_lens.append(p)
        spans.append(row)
        width = max(width, start)
    return segment_layout(prompt_lens, spans, width), width, pairs * SHAPE["heads"]


def measure(libs: dict, rows: int, group: int, layers: int, reps: int) -> dict:
    """Median seconds of `layers` forward and backward calls per build, each layer on its own tensors."""
    import torch

    layout, width, pairs = micro_batch(rows, group, seed=rows)
    h, kvh, d = SHAPE["heads"], SHAPE["kv_heads"], SHAPE["head_dim"]
    tensors = []
    for _ in range(layers):
        q, k, v = torch.randn(rows, h, width, d), torch.randn(rows, kvh, width, d), torch.randn(rows, kvh, width, d)
        out, lse, dout = torch.zeros(rows, width, h, d), torch.zeros(rows, h, width), torch.randn(rows, width, h, d)
        tensors.append((q, k, v, out, lse, dout, torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)))
    prompt_lens, spans = layout.prompt_lens.contiguous(), layout.spans.contiguous()
    threads = torch.get_num_threads()
    times = {name: ([], []) for name in libs}
    for rep in range(reps + 1):
        for name, lib in libs.items():
            fwd = bwd = 0.0
            for q, k, v, out, lse, dout, dq, dk, dv in tensors:
                head = (rows, width, kvh, h // kvh, d, q.data_ptr(), k.data_ptr(), v.data_ptr(), prompt_lens.data_ptr(),
                        spans.shape[0], spans.data_ptr(), d ** -0.5)
                t0 = time.perf_counter()
                lib.relayrl_segment_attention_fwd(*head, out.data_ptr(), lse.data_ptr(), threads)
                t1 = time.perf_counter()
                for g in (dq, dk, dv):  # the trainer hands the kernel zeroed gradients
                    g.zero_()
                t2 = time.perf_counter()
                lib.relayrl_segment_attention_bwd(*head, out.data_ptr(), lse.data_ptr(), dout.data_ptr(), dq.data_ptr(),
                                                  dk.data_ptr(), dv.data_ptr(), threads)
                fwd, bwd = fwd + t1 - t0, bwd + time.perf_counter() - t2
            if rep:  # the first pass warms up
                times[name][0].append(fwd)
                times[name][1].append(bwd)
    case = {"rows": rows, "width": width, "visible_pairs_per_layer": pairs, "layers": layers}
    for name, (f, b) in times.items():
        fm, bm = statistics.median(f), statistics.median(b)
        case |= {f"{name}_fwd_ms": 1e3 * fm, f"{name}_bwd_ms": 1e3 * bm,
                 f"{name}_fwd_gflops": layers * pairs * 4 * d / fm / 1e9,
                 f"{name}_bwd_gflops": layers * pairs * 10 * d / bm / 1e9}
    if "baseline" in libs:
        case |= {"fwd_speedup": case["baseline_fwd_ms"] / case["kernel_fwd_ms"],
                 "bwd_speedup": case["baseline_bwd_ms"] / case["kernel_bwd_ms"]}
    return case


def main() -> None:
    a = parse_args()
    from relayrl.models import segments

    libs = _common.kernel_builds(segments.load_kernel(), segments.build, a.baseline_source)
    layers, reps = (3, 2) if a.quick else (SHAPE["layers"], a.reps)
    cases = []
    for rows in map(int, a.rows.split(",")):
        c = measure(libs, rows, a.group, layers, reps)
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in c.items()}, file=sys.stderr)
        cases.append(c)
    res = {**_common.result_header("segment_attention"), "shape": SHAPE, "group": a.group, "reps": reps,
           "baseline_source": a.baseline_source, "cases": cases}
    print(json.dumps(res, indent=2))
    if a.out:
        _common.write_json(a.out, res)


if __name__ == "__main__":
    sys.exit(main())
