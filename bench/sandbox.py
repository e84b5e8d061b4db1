#!/usr/bin/env python
"""Per-call latency of the python tool's sandbox: `print(1)` through `run_python`, bwrap vs unsandboxed.

Each call is what a tool call costs end to end: memfd set-up, bwrap start (namespaces, mounts, seccomp), the
interpreter's start-up (`python -I -S`), the prelude (rlimits, fork) and the script, then reading the output.
`sandbox=none` runs the same prelude and script as a plain subprocess, so the difference of the medians is the
price of the OS boundary (as root the sandbox may run the system python instead of the caller's: see
`interpreter` and `none_interpreter` in the JSON). Calls run one after another (a rollout runs many concurrently; this
measures latency, not throughput). The one-off probe (first use in a process) is reported separately.

    .venv/bin/python bench/sandbox.py             # 50 calls each, writes bench/results/sandbox.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

import _common

from relayrl.tools import run_python
from relayrl.tools.bwrap import ready


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=str(_common.REPO / "bench" / "results" / "sandbox.json"))
    return p.parse_args(argv)


async def latencies(mode: str, calls: int, warmup: int) -> list[float]:
    """Wall-clock seconds of each call, from the caller's side (run_python's whole await)."""
    out = []
    for i in range(warmup + calls):
        t0 = time.perf_counter()
        r = await run_python("print(1)", sandbox=mode)
        dt = time.perf_counter() - t0
        assert r.ok and r.stdout == "1\n", r
        if i >= warmup:
            out.append(dt)
    return out


def summary(xs: list[float]) -> dict:
    ms = sorted(x * 1000 for x in xs)
    return {"calls": len(ms), "median_ms": round(statistics.median(ms), 2), "min_ms": round(ms[0], 2),
            "max_ms": round(ms[-1], 2), "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 2)}


def cpu_capability() -> str | None:
    try:
        import torch

        return torch.backends.cpu.get_cpu_capability()
    except ImportError:
        return None


def main(argv=None) -> dict:
    args = parse_args(argv)
    load = _common.load_before_run()
    t0 = time.perf_counter()
    box = ready()  # the once-per-process probe: a real sandbox start
    probe_s = time.perf_counter() - t0
    bwrap_s = asyncio.run(latencies("bwrap", args.calls, args.warmup))
    none_s = asyncio.run(latencies("none", args.calls, args.warmup))
    version = subprocess.run([box.binary, "--version"], capture_output=True, text=True).stdout.strip()
    result = _common.result_header("sandbox")
    result["machine"]["cpu_capability"] = cpu_capability()
    result.update(load_1min_before=load, bwrap=version, interpreter=box.interpreter,
                  none_interpreter=os.path.realpath(sys.executable),
                  host_uid=box.user if box.user is not None else "caller", probe_ms=round(probe_s * 1000, 2),
                  per_call={"bwrap": summary(bwrap_s), "none": summary(none_s)})
    result["bwrap_overhead_median_ms"] = round(result["per_call"]["bwrap"]["median_ms"]
                                               - result["per_call"]["none"]["median_ms"], 2)
    print(json.dumps(result, indent=2))
    _common.write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
