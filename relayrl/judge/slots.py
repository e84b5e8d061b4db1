"""`Slots`: at most n holders at once across the processes of one run's judge, for an LLM judge's `concurrency`.

Why across processes: the judge's workers are separate processes, each scoring its own batch. A semaphore in each
would bound requests per worker (judge.workers x concurrency in all), not what a user means by "at most 8
requests in flight to my endpoint".

Why file locks: slot i is a file; holding it is an exclusive `flock` on a descriptor opened for that hold (flock
locks belong to the open file, so two holds in one process exclude each other too). The kernel drops a lock when
its process dies, so a worker killed mid-request (a timeout, a crash) never leaks a slot, and no process has to
clean up after another. A waiter polls the slots (every 5 to 50 ms): negligible next to a model's reply.

Scope: the processes one parent started (its pid is in the file names), i.e. one run's judge workers, whichever
pool (training, eval) they belong to; two runs on a machine do not share slots. Called outside a worker, the
process itself is the scope. The files are empty and stay in the temp folder (removing one while another process
holds it would let a third take the same slot).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import multiprocessing as mp
import os
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

_POLL = (0.005, 0.05)  # first and longest wait between tries, seconds


def scope() -> int:
    """The pid whose children share slots: the parent of a worker process, else this process."""
    parent = mp.parent_process()
    return parent.pid if parent is not None and parent.pid is not None else os.getpid()


class Slots:
    """`n` slots named by `key` (e.g. the judge's name and endpoint) within `scope()`."""

    def __init__(self, key: str, n: int, folder: str | os.PathLike | None = None):
        if n < 1:
            raise ValueError(f"slots need n >= 1, got {n}")
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        base = Path(folder or tempfile.gettempdir()) / "relayrl-slots"
        base.mkdir(parents=True, exist_ok=True)
        self.paths = [base / f"{scope()}-{digest}-{i}" for i in range(n)]

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        """Wait for a free slot, hold it for the block."""
        fd, wait = self._try(), _POLL[0]
        while fd is None:
            await asyncio.sleep(wait)
            fd, wait = self._try(), min(2 * wait, _POLL[1])
        try:
            yield
        finally:
            os.close(fd)  # closing the descriptor drops its lock

    def _try(self) -> int | None:
        """A descriptor holding a free slot's lock, or None if all are held."""
        for path in self.paths:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                os.close(fd)
            except BaseException:
                os.close(fd)
                raise
        return None
