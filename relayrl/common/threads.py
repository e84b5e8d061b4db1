"""Threads: blocking user code on an asyncio loop (a daemon thread per call, abandoned at its caller's timeout),
and the native thread pools and kernel caches under torch (OpenMP teams, oneDNN caches).

Callers of `in_thread`: user tool functions (relayrl/tools/functions.py) and environments' plain `reset`/`step` methods
(relayrl/envs/base.py). Both are trusted code that may block or hang; one hung call must cost that call only.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any


async def in_thread(fn: Callable[..., Any], arguments: dict[str, Any], kind: str = "tool") -> Any:
    """Run a blocking function in a daemon thread of its own. Not `asyncio.to_thread`: its pool's threads are
    joined at interpreter exit and capped in number, so a function that never returns would hold the run's
    exit and, after a few hangs, every later call. A hung daemon thread is abandoned at the timeout (Python
    cannot kill a thread) and dies with the process. The thread is named relayrl-<kind>-<function name>, so a
    hung one is recognisable in a stack dump."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():  # cancelled at the timeout: nobody waits any more
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    def target() -> None:
        try:
            result, error = fn(**arguments), None
        except Exception as e:
            result, error = None, e
        except BaseException as e:  # SystemExit and the like: a failed call, not a stop of the rollout loop
            result, error = None, RuntimeError(f"{type(e).__name__}: {e}")
        with contextlib.suppress(RuntimeError):  # the loop closed while the function ran
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=target, name=f"relayrl-{kind}-{getattr(fn, '__name__', 'fn')}", daemon=True).start()
    return await future


@functools.cache
def _omp_pause():
    """omp_pause_resource_all of the libgomp torch loaded (never a second copy of the runtime), or None."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    path = next((f for f in (line.split()[-1] for line in maps.splitlines()) if "libgomp" in f and f[:1] == "/"), None)
    if path is None:
        return None
    fn = getattr(ctypes.CDLL(path), "omp_pause_resource_all", None)
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return fn


def release_openmp_threads() -> None:
    """Let the calling thread's OpenMP workers exit before it waits while another thread computes.

    Each Python thread that runs torch ops owns an OpenMP team. Once libgomp manages more threads than there
    are CPUs (the engine's worker and the trainer's thread, two teams of two on two cores), it stops spinning
    between parallel regions and every small op pays a futex wake-up, which makes elementwise ops several times
    slower and costs a decode step much of its time (docs/benchmarks.md, "Rollout speed"). A thread about to wait
    gives its team back; its next op builds a new one, a one-off cost far below a wake-up per op.
    Called only by a thread about to block (LocalEngine's creator, Env.run), never under a lock.
    """
    import torch  # noqa: F401 - libgomp is torch's; load it before looking for it

    pause = _omp_pause()
    if pause is not None:
        pause(1)  # omp_pause_soft


ONEDNN_CACHE_CAPACITY = 128  # kernels kept per cache: a step's distinct bf16 matmul shapes, with room


def bound_onednn_caches() -> None:
    """Keep at most ONEDNN_CACHE_CAPACITY kernels in each of oneDNN's caches (its primitive cache and ideep's).

    On a CPU every bf16 matmul (autocast, a bf16 engine) runs through a oneDNN kernel built for its exact shape
    and kept in two caches of 1024 entries each. Training shapes follow each micro-batch's token count, so they
    rarely repeat across steps: every step adds new shapes, and the heap grows step after step until both caches
    are full, hundreds of MB later (docs/benchmarks.md, "bf16 autocast by default where it is native"). A kernel is
    rebuilt in about a millisecond, and within one step the shapes that repeat (30 layers of one shape) stay cached.
    Read when the first oneDNN kernel is built, so this must run before the first bf16 matmul; exported values win.
    """
    for var in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):  # oneDNN's, ideep's (0 crashes it)
        os.environ.setdefault(var, str(ONEDNN_CACHE_CAPACITY))
