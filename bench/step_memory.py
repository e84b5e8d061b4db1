#!/usr/bin/env python
"""Memory step by step through a real `relayrl train`: where a run's resident memory goes and whether it grows.

Runs the CLI in this process (arguments after `--` are `relayrl train`'s) and, after each step, records the
step's time, RSS now and its high-water mark, glibc's heap (bytes in use, free inside the heap, mapped apart)
and the bytes of live CPU tensors by dtype (found through the garbage collector). A heap in use that climbs
while live tensors stay flat is memory held outside tensors: that is how the bf16 kernel caches were found
(docs/benchmarks.md, "bf16 autocast by default where it is native"). Environment variables that change what
is measured (oneDNN's cache capacities, the allocator settings) are recorded with the rows.

    .venv/bin/python bench/step_memory.py --out bench/results/step_memory.json -- \\
        --config examples/arithmetic_grpo.yaml run.steps=10 eval.at_start=false eval.at_end=false eval.every=0
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
from collections import Counter

import _common

from relayrl.common.utils import heap_gb

RECORDED_ENV = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY", "RELAYRL_MMAP_THRESHOLD",
                "RELAYRL_MALLOC_ARENAS", "MALLOC_ARENA_MAX", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


def live_tensor_gb() -> dict[str, float]:
    """Bytes of the CPU tensor storages alive now, by dtype (each storage once, however many views share it)."""
    import torch

    seen, by_dtype = set(), Counter()
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                by_dtype[str(obj.dtype).removeprefix("torch.")] += storage.nbytes()
    return {k: v / 1e9 for k, v in by_dtype.items() if v}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="after --: relayrl train's arguments")
    a = p.parse_args()
    args = [x for x in a.train_args if x != "--"]
    import relayrl.run.loop as loop
    from relayrl.cli import main as cli_main

    rows, perf = [], loop._perf

    def recording_perf(c, metrics, step_s):
        out = perf(c, metrics, step_s)
        rows.append({"step_s": round(step_s, 2), "rss_gb": out.get("mem/rss_gb"),
                     "peak_rss_gb": out.get("mem/peak_rss_gb"), "train_tokens": metrics.get("train/tokens"),
                     **heap_gb(), "live_tensors_gb": live_tensor_gb()})
        print("step_memory: " + json.dumps(rows[-1]), flush=True)
        return out

    loop._perf = recording_perf
    with tempfile.TemporaryDirectory(prefix="bench_step_memory_") as tmp:
        rc = cli_main(["train", *args, f"run.output_dir={tmp}", "run.save_final=false"])
    _common.write_json(a.out, _common.result_header("step_memory") | {
        "train_args": args, "env": {k: os.environ[k] for k in RECORDED_ENV if k in os.environ}, "exit_code": rc,
        "steps": rows})
    sys.exit(rc)


if __name__ == "__main__":  # judge workers are spawned: they re-import this file and must not run it
    main()
