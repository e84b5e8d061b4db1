#!/usr/bin/env python
"""Per-call latency of the python tool's sandbox: `print(1)` through `run_python`, bwrap vs unsandboxed.

Each call is what a tool call costs end to end: memfd set-up, bwrap start (namespaces, mounts, seccomp), the
interpreter's start-up (`python -I -S`), the prelude (rlimits, fork) and the script, then reading the output.
`sandbox=none` runs the same prelude and script as a plain subprocess, so the difference of the medians is the
price of the OS boundary (as root the sandbox may run the system python instead of the caller's: see
`interpreter` and `none_interpreter` in the JSON). Calls run one after another (a rollout runs many concurrently; this
measures latency, not throughput). The one-off probe (first use in a process) is reported separately.

    .venv/bin/python bench/sandbox.py             # 50 calls each, writes bench/results/sandbox.json

`--concurrent N` measures instead what a rollout sees: N calls at once from a process whose heap is
`--heap-gb` (allocated and touched here, as a trainer's is), with a ticker coroutine on the same event loop
measuring its own lateness: the longest stall is what every other agent of the loop waited. Latency counts
from the call (so it includes waiting for a slot under the concurrency cap). `--old-start` starts sandboxes as
before the fix, to compare: Popen with user/group on the event loop's thread (a fork of the whole heap; only
differs as root).

    .venv/bin/python bench/sandbox.py --concurrent 50 --heap-gb 3   # bench/results/sandbox_concurrent.json
    .venv/bin/python bench/sandbox.py --concurrent 50 --heap-gb 3 --old-start  # ..._concurrent_old.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

import _common

from relayrl.tools import bwrap, run_python, sandbox
from relayrl.tools.bwrap import ready


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--concurrent", type=int, default=0, help="N calls at once instead of one after another")
    p.add_argument("--heap-gb", type=float, default=3.0, help="with --concurrent: this process's heap")
    p.add_argument("--max-concurrent", type=int, default=None, help="the sandbox cap (default: the library's)")
    p.add_argument("--old-start", action="store_true", help="start sandboxes the pre-fix way (see the doc)")
    p.add_argument("--out", default=None)
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


async def concurrent(calls: int, tick_s: float = 0.005) -> tuple[list[float], float, float]:
    """Latency of each of `calls` simultaneous calls, the ticker's longest lateness, the wall time of all."""
    stalls, done = [0.0], asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            t = time.perf_counter()
            await asyncio.sleep(tick_s)
            stalls.append(time.perf_counter() - t - tick_s)

    async def one() -> float:
        t = time.perf_counter()
        r = await run_python("print(1)")
        assert r.ok and r.stdout == "1\n", r
        return time.perf_counter() - t

    await run_python("print(1)")  # warm
    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.1)
    t0 = time.perf_counter()
    lat = await asyncio.gather(*(one() for _ in range(calls)))
    wall = time.perf_counter() - t0
    done.set()
    await tick
    return list(lat), max(stalls), wall


def old_start() -> None:
    """The start as it was: Popen with user/group (no dropper, so no vfork) on the event loop's thread."""
    box = ready()
    bwrap._CACHE[bwrap.bwrap_binary()] = dataclasses.replace(box, dropper=())
    ids = {"user": box.user, "group": box.user, "extra_groups": []} if box.user is not None else {}

    async def spawn(argv: list[str], **popen) -> subprocess.Popen:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True, **ids, **popen)

    sandbox._spawn = spawn


def percentile(xs: list[float], q: float) -> float:
    ms = sorted(x * 1000 for x in xs)
    return round(ms[min(len(ms) - 1, int(q * len(ms)))], 2)


def main_concurrent(args: argparse.Namespace) -> dict:
    load = _common.load_before_run()
    box = ready()
    if args.max_concurrent:
        sandbox.set_max_concurrent(args.max_concurrent)
    if args.old_start:
        old_start()
    heap = bytearray(int(args.heap_gb * 2**30))
    heap[::4096] = b"\1" * len(range(0, len(heap), 4096))
    lat, stall, wall = asyncio.run(concurrent(args.concurrent))
    result = _common.result_header("sandbox_concurrent")
    result["machine"]["cpu_capability"] = cpu_capability()
    result.update(load_1min_before=load, host_uid=box.user if box.user is not None else "caller",
                  start="old: Popen user/group on the loop" if args.old_start else "dropper exec (vfork)",
                  dropper=list(box.dropper[:1]), heap_gb=args.heap_gb, calls=args.concurrent,
                  max_concurrent=sandbox._GATE.limit, p50_ms=percentile(lat, 0.5), p99_ms=percentile(lat, 0.99),
                  max_ms=percentile(lat, 1.0), longest_loop_stall_ms=round(stall * 1000, 2),
                  wall_s=round(wall, 3))
    del heap
    print(json.dumps(result, indent=2))
    name = "sandbox_concurrent_old.json" if args.old_start else "sandbox_concurrent.json"
    _common.write_json(args.out or _common.REPO / "bench" / "results" / name, result)
    return result


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
    if args.concurrent:
        return main_concurrent(args)
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
    _common.write_json(args.out or _common.REPO / "bench" / "results" / "sandbox.json", result)
    return result


if __name__ == "__main__":
    main()
