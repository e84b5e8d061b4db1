"""relayrl.common helpers (files, imports, errors, memory, threads) that the rest of the package leans on."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from relayrl.common.errors import close_all
from relayrl.common.memory import heap_gb


def test_close_all_closes_every_part_and_raises_the_first_failure():
    closed = []

    def fail(name):
        def close():
            closed.append(name)
            raise RuntimeError(name)
        return close

    try:
        close_all([fail("a"), None, lambda: closed.append("b"), fail("c")])
    except RuntimeError as e:
        assert str(e) == "a"
    else:
        raise AssertionError("close_all swallowed the failure")
    assert closed == ["a", "b", "c"]


ARENA_PROBE = """
import ctypes, threading
from relayrl.common.memory import tune_allocator
tune_allocator()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def work():
    for _ in range(200):
        libc.free(libc.malloc(1 << 16))
threads = [threading.Thread(target=work) for _ in range(4)]
[t.start() for t in threads]
[t.join() for t in threads]
libc.malloc_stats()  # one 'Arena N:' block per arena, on stderr
"""


def _arenas(env: dict) -> int:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"} | env
    err = subprocess.run([sys.executable, "-c", ARENA_PROBE], env=env, capture_output=True, text=True,
                         check=True).stderr
    return sum(line.startswith("Arena ") for line in err.splitlines())


def test_tune_allocator_keeps_every_thread_on_one_malloc_arena():
    # each thread that allocates gets its own glibc heap unless limited; the README job's peak at two threads
    # came from such heaps (docs/benchmarks.md)
    assert _arenas({"RELAYRL_MALLOC_ARENAS": "0"}) > 1  # glibc's default: the probe does make arenas
    assert _arenas({}) == 1


THP_PROBE = """
import os, sys
from relayrl.common.memory import tune_allocator
tune_allocator()
import torch
x = torch.empty(16 << 20, dtype=torch.uint8)
x.fill_(1)
addr = x.data_ptr()
huge = 0
with open("/proc/self/smaps") as f:
    inside = False
    for line in f:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "AnonHugePages:":
            huge = int(line.split()[1])
print(os.environ.get("THP_MEM_ALLOC_ENABLE", "unset"), huge)
"""


def _thp_probe(env: dict) -> tuple[str, int]:
    env = {k: v for k, v in os.environ.items() if k not in ("THP_MEM_ALLOC_ENABLE", "RELAYRL_MMAP_THRESHOLD")} | env
    out = subprocess.run([sys.executable, "-c", THP_PROBE], env=env, capture_output=True, text=True, check=True)
    flag, kb = out.stdout.split()
    return flag, int(kb)


def test_a_fixed_mmap_threshold_brings_huge_pages_for_torch_tensors():
    """RELAYRL_MMAP_THRESHOLD maps every large block on its own; each fresh 4 KB page would fault, so torch is
    asked for transparent huge pages on its tensors (checked in the kernel's own account of the mapping)."""
    assert _thp_probe({})[0] == "unset"  # the default: glibc's dynamic threshold, no huge pages asked for
    flag, huge_kb = _thp_probe({"RELAYRL_MMAP_THRESHOLD": str(1 << 20)})
    assert flag == "1"
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if "[never]" in (thp.read_text() if thp.exists() else "[never]"):
        pytest.skip("transparent huge pages are off on this kernel ([never]): nothing to measure")
    assert huge_kb >= 2048  # the 16 MB tensor sits (at least partly) on 2 MB pages
    assert _thp_probe({"RELAYRL_MMAP_THRESHOLD": str(1 << 20), "THP_MEM_ALLOC_ENABLE": "0"})[0] == "0"  # user wins


ONEDNN_PROBE = r"""
import sys
from relayrl.common.memory import heap_gb, tune_allocator
if sys.argv[1] == "bound":
    tune_allocator()  # what `relayrl train` and build() call first
import torch

w = torch.randn(512, 256, dtype=torch.bfloat16)


def matmuls(lo, hi):  # one bf16 matmul per row count, as micro-batches of varying token counts make
    for m in range(lo, hi):
        torch.randn(m, 256, dtype=torch.bfloat16) @ w.t()


matmuls(1, 201)
before = heap_gb()["heap_in_use_gb"]
matmuls(201, 601)
print((heap_gb()["heap_in_use_gb"] - before) * 1e3)
"""


def _onednn_growth_mb(mode: str) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    out = subprocess.run([sys.executable, "-c", ONEDNN_PROBE, mode], env=env, capture_output=True, text=True,
                         check=True)
    return float(out.stdout)


def test_bf16_matmul_kernel_caches_stay_bounded_as_shapes_vary():
    """Every new bf16 matmul shape leaves oneDNN kernels (~0.5 MB) in two 1024-entry caches: the step-by-step
    growth of an autocast run. tune_allocator caps both, so 400 new shapes after 200 leave the heap flat."""
    if not heap_gb():
        pytest.skip("the heap is measured with glibc's mallinfo2 (glibc >= 2.33), absent here")
    unbounded = _onednn_growth_mb("none")
    if unbounded < 50:
        pytest.skip(f"bf16 matmuls do not build oneDNN kernels on this CPU (heap grew {unbounded:.1f} MB "
                    f"for 400 shapes; no native bf16): nothing to bound")
    assert _onednn_growth_mb("bound") < 0.1 * unbounded, unbounded


HEAP_PROBE = """
import sys
from relayrl.common.memory import fit_allocator_to
import torch
big = torch.empty(16 << 20, dtype=torch.uint8)
big.fill_(1)
del big  # freeing a mapped 16 MB block raises glibc's dynamic mmap threshold to 16 MB
why = fit_allocator_to(int(sys.argv[1]))
x = torch.empty(4 << 20, dtype=torch.uint8)
addr, where = x.data_ptr(), "?"
with open("/proc/self/maps") as f:
    for line in f:
        parts = line.split()
        lo, hi = (int(v, 16) for v in parts[0].split("-"))
        if lo <= addr < hi:
            where = parts[5] if len(parts) > 5 else "anonymous"
print("at once" in why, where)
"""


def _heap_probe(floor: int, env: dict) -> tuple[bool, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RELAYRL_MMAP_THRESHOLD",)} | env
    out = subprocess.run([sys.executable, "-c", HEAP_PROBE, str(floor)], env=env, capture_output=True, text=True,
                         check=True)
    decided, where = out.stdout.split()
    return decided == "True", where


def test_the_mmap_threshold_is_fixed_only_when_the_training_floor_is_a_large_share_of_ram():
    """A 4 MB activation-sized block comes from the heap under glibc's risen threshold (where freed blocks are
    kept); with the floor at a fifth of the RAM or more, it gets its own mapping (returned when freed).
    RELAYRL_MMAP_THRESHOLD, when set (0 included), wins."""
    from relayrl.common.memory import TIGHT_FLOOR_SHARE, mem_total_bytes

    total = mem_total_bytes()
    assert total and total > 1 << 30
    small, large = int(TIGHT_FLOOR_SHARE * total) - 1, int(TIGHT_FLOOR_SHARE * total) + 1
    assert _heap_probe(small, {}) == (False, "[heap]")
    assert _heap_probe(large, {}) == (True, "anonymous")
    assert _heap_probe(large, {"RELAYRL_MMAP_THRESHOLD": "0"}) == (False, "[heap]")
