"""Memory: glibc malloc tuning, the training floor and when memory is tight, and readings of what a process holds.

The floor is what training cannot go below: fp32 weights, gradients and AdamW moments, 16 bytes per trainable
parameter. `memory_is_tight` compares it with the device's memory; "auto" settings (gradient checkpointing, the
allocator's mmap threshold) follow from that comparison.
"""

from __future__ import annotations

import ctypes
import functools
import os
import resource
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from relayrl.common.threads import bound_onednn_caches

# ---- glibc malloc --------------------------------------------------------------------------------------------
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:  # not glibc (musl, macOS): their allocators behave differently; nothing to tune
        return None


@functools.cache
def tune_allocator() -> None:
    """Set glibc malloc for a training process; call before any thread allocates (a no-op off glibc).

    One arena (RELAYRL_MALLOC_ARENAS, default 1; 0 keeps glibc's default, 8 per core): glibc gives each thread
    that allocates under contention its own heap, and one heap's freed pages are no use to another, so the
    engine's worker thread and the trainer's thread each kept their own high-water mark, and the peaks add up
    (docs/benchmarks.md, "The whole job, phase by phase"). A MALLOC_ARENA_MAX the user exported wins.

    Opt-in (RELAYRL_MMAP_THRESHOLD=BYTES): give every allocation of at least BYTES its own mapping. glibc's
    threshold rises (up to 32 MB) each time a mapped block is freed, so a step's activations (blocks of tens of
    MB) land in heaps that keep their freed holes; a fixed threshold returns them at once but every such block then
    pays fresh page faults. With it, torch is asked for transparent huge pages on its large tensors
    (THP_MEM_ALLOC_ENABLE, read once by torch's allocator, so only when torch is not imported yet and the
    variable is unset): one fault per 2 MB instead of 512. It trades step time for a lower peak
    (docs/benchmarks.md, "Scaling with model size"), and huge pages win back part of the time.
    Unset, it is decided per run once the trainer knows its size (`fit_allocator_to`); 0 keeps it off.
    `trim_memory` between phases gives the held memory back; once per phase, the page faults it causes are few.

    Also bounds oneDNN's two kernel caches (`bound_onednn_caches`), on any platform.
    """
    bound_onednn_caches()
    libc = _glibc()
    if libc is None:
        return
    arenas = int(os.environ.get("RELAYRL_MALLOC_ARENAS", "1"))
    if arenas > 0 and "MALLOC_ARENA_MAX" not in os.environ:
        libc.mallopt(_M_ARENA_MAX, arenas)
    threshold = int(os.environ.get("RELAYRL_MMAP_THRESHOLD") or "0")
    if threshold > 0:
        libc.mallopt(_M_MMAP_THRESHOLD, threshold)
        libc.mallopt(_M_TRIM_THRESHOLD, 2 * threshold)
        if "torch" not in sys.modules:
            os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


AUTO_MMAP_THRESHOLD = 1 << 20  # what fit_allocator_to sets: blocks of 1 MiB and more get their own mapping


# memory is "tight" when the training floor (training_floor: 16 bytes per fp32 parameter) is at least this share of
# the memory that holds it: a step without the memory settings reaches several times its floor (docs/benchmarks.md,
# "Scaling with model size")
TIGHT_FLOOR_SHARE = 0.2


def training_floor(params: Iterable[Any]) -> tuple[int, int]:
    """(bytes, parameters) of the trainable `params`' floor: weights, gradients and two AdamW moments, all in the
    weights' dtype: 16 bytes per fp32 parameter, 8 per bf16 one (model.train_dtype). Moments kept in bf16 under
    fp32 weights (train.optimizer_state_dtype) are a saving below this floor, not a lower floor."""
    params = [p for p in params if p.requires_grad]
    return sum(4 * p.element_size() * p.numel() for p in params), sum(p.numel() for p in params)


def memory_is_tight(floor_bytes: int, total_bytes: int | None) -> bool:
    """Whether a run with this floor should trade a little speed for memory (model.gradient_checkpointing "auto",
    fit_allocator_to): yes when the floor is at least TIGHT_FLOOR_SHARE of `total_bytes` (None: unknown, no)."""
    return bool(total_bytes) and floor_bytes >= TIGHT_FLOOR_SHARE * total_bytes


def checkpointing_on(setting: bool | str, floor_bytes: int, total_bytes: int | None) -> bool:
    """model.gradient_checkpointing as a floor makes it: "auto" -> `memory_is_tight`, else the setting (a run decides
    it once at start-up, relayrl.run.resolve; benchmarks that plan a run ask here)."""
    return memory_is_tight(floor_bytes, total_bytes) if setting == "auto" else bool(setting)


def fit_allocator_to(floor_bytes: int) -> str:
    """Fix glibc's mmap threshold at 1 MiB when this process's training floor (16 bytes per trainable parameter)
    is a large share of the machine's RAM (`memory_is_tight`) and RELAYRL_MMAP_THRESHOLD is unset; say what the
    allocator does now.

    Why a rule and not a default: the threshold takes the heap's retention of freed activations away (a lower
    peak relative to the floor) but every large block then pays fresh page faults, a step-time cost that is
    largest for small models (docs/benchmarks.md, "Scaling with model size"). Where the floor is small next to the
    RAM (the README job) memory is not what limits the run and the time is kept; where it is large, the retention
    (a sizeable fraction of the floor) decides whether the run fits. Set after torch is loaded, so without the
    huge pages tune_allocator asks for (they recover part of the cost only for small models). Applies to the blocks
    allocated from now on: the activations of training.
    """
    setting = os.environ.get("RELAYRL_MMAP_THRESHOLD") or ""
    libc = _glibc()
    if libc is None:
        return "the system's allocator (not glibc: nothing to tune)"
    if setting:
        threshold = int(setting)
        return (f"blocks >= {threshold} bytes mapped on their own (RELAYRL_MMAP_THRESHOLD)" if threshold > 0
                else "glibc's heap (RELAYRL_MMAP_THRESHOLD=0)")
    if not memory_is_tight(floor_bytes, mem_total_bytes()):
        return "glibc's heap (auto)"
    libc.mallopt(_M_MMAP_THRESHOLD, AUTO_MMAP_THRESHOLD)
    libc.mallopt(_M_TRIM_THRESHOLD, 2 * AUTO_MMAP_THRESHOLD)
    return "freed blocks >= 1 MiB go back to the OS at once (auto; RELAYRL_MMAP_THRESHOLD=0 for glibc's heap)"


def mem_total_bytes() -> int | None:
    """The machine's RAM (MemTotal of /proc/meminfo), or None where there is no such file."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def memory_gb() -> dict[str, float]:
    """This process's resident memory now and its high-water mark so far, in GB (Linux; {} elsewhere): logged
    every step, so a run shows where its peak came and how far above the 16 bytes/param floor it sits."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return {}
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KB on Linux
    return {"mem/rss_gb": pages * os.sysconf("SC_PAGE_SIZE") / 1e9, "mem/peak_rss_gb": peak_kb * 1024 / 1e9}


class _MallInfo2(ctypes.Structure):
    """glibc's struct mallinfo2 (glibc >= 2.33): the heap's counters in size_t."""

    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_gb() -> dict[str, float]:
    """glibc's own account of its heap, in GB: bytes in use, free inside the heap, and blocks mapped on their
    own ({} off glibc or before 2.33). A heap in use that climbs while live tensors stay flat is memory held
    outside tensors: how the bf16 kernel caches were found (`bound_onednn_caches`, bench/memory.py step_memory)."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return {}
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return {"heap_in_use_gb": info.uordblks / 1e9, "heap_free_gb": info.fordblks / 1e9, "mapped_gb": info.hblkhd / 1e9}


def trim_memory() -> None:
    """Give free heap pages back to the OS (malloc_trim) between the phases of a step; a no-op off glibc."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
