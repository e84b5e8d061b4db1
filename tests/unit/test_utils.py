"""relayrl.common.utils helpers that the rest of the package leans on."""

import os
import subprocess
import sys

from relayrl.common.utils import close_all


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
from relayrl.common.utils import tune_allocator
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
