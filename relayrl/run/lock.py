"""One run per folder at a time: an advisory lock on RUN_DIR/.lock, held for the run's life.

Two runs writing one folder interleave their metrics.jsonl lines, and a resume sets aside (or deletes as a killed
run's leftover) what the other is writing: its logs, its checkpoint being built. So the process that owns a run
folder (the colocated or trainer process; rank 0 of a data-parallel trainer; never a producer process or a
follower rank, which write only where it tells them) takes `flock` on the lock file before it moves or writes
anything there, and a second run on that folder stops with one line naming the holder.

flock, not a pid file: the kernel drops the lock when its holder exits, however it dies (SIGKILL, OOM), so a
stale lock file never blocks anyone and there is nothing to clean up. The file records who holds it (pid, host,
start time) only for the message. The descriptor is close-on-exec, so processes the run starts (servers, judge
workers) never hold it after their owner is gone. flock does not lock across NFS on every setup; a shared
filesystem without it gets no protection from this (docs/security.md).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from relayrl.common.errors import InputError

LOCK_FILE = ".lock"


class RunLock:
    """The held lock of one run folder; `release()` (or the process's exit) lets the next run in."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd: int | None = fd
        self.path = path

    @classmethod
    def acquire(cls, run_dir: Path) -> RunLock:
        """Lock `run_dir` (created if needed) or raise InputError naming the process that holds it. An OSError
        (the folder cannot be created or written) propagates with its path."""
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _holder(fd)
            os.close(fd)
            if e.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):
                raise
            raise InputError(f"{run_dir} is in use by another run ({holder}): one run writes a folder at a time; "
                             "wait for it, stop it, or choose another run.name / run.output_dir") from None
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        return cls(fd, path)

    def release(self) -> None:
        """Unlock (the file stays: removing it would let a third run lock a new file while a second holds the
        old one). Safe to call twice."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def _holder(fd: int) -> str:
    """'pid P on host H, started at T' from the lock file, as far as it can be read."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        record = json.loads(os.pread(fd, 4096, 0) or b"{}")
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(record["started"])))
        return f"pid {int(record['pid'])} on host {record['host']}, started {started}"
    return "a process that has not written its pid yet"
