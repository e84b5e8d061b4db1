"""Run untrusted Python (model-written tool code) behind an OS boundary: bubblewrap namespaces.

Model-written code is treated as hostile. Each call runs in a fresh bwrap sandbox (relayrl/tools/bwrap.py;
threat model, flags and the escape attempts tried in docs/security.md):
- its own user, pid, network, ipc, uts and cgroup namespaces: it sees only its own processes, has no network
  (a private loopback), and cannot create further user namespaces;
- a read-only root holding only the system libraries and the Python installation, a fresh /proc of its pid
  namespace, a minimal /dev, tmpfs mounts capped in size and inodes for /scratch (its working directory), /tmp
  and /dev/shm;
- an empty environment (PATH, HOME=/scratch, TMPDIR, LANG), stdin closed, a new session (no terminal);
- rlimits set inside before the code runs: address space, CPU seconds, file size, processes, open files;
- a seccomp deny-list of rarely needed, often exploited syscalls, SysV IPC among them (relayrl/tools/seccomp.py);
- stdout and stderr through pipes read to a cap, so no host file exists that the code could grow or fallocate;
- a wall-clock kill of the sandbox's pid 1, which takes every process of the sandbox with it;
- a process-wide cap on sandboxes running at once (`set_max_concurrent`), so concurrent calls cannot multiply the
  per-call bounds without end; the start itself is a vfork-cheap exec (bwrap.py), never a fork of a large heap.

`sandbox="none"` runs the same code as a plain subprocess with the same rlimits (no namespaces): only for
machines where no boundary can start, only when the user writes it, and warned about at start-up.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from relayrl.tools import bwrap, seccomp
from relayrl.tools.bwrap import PRELUDE, SandboxUnavailable

__all__ = ["MODES", "SandboxMode", "SandboxResult", "SandboxUnavailable", "check_sandbox", "run_python",
           "set_max_concurrent"]
SandboxMode = Literal["auto", "bwrap", "none"]
MODES = ("auto", "bwrap", "none")
# Sandboxes running at once in this process: each may hold memory_mb of address space and 3 x file_mb of tmpfs,
# so the cap bounds the host memory all calls together can take; beyond it calls wait their turn.
DEFAULT_MAX_CONCURRENT = min(32, max(4, 2 * (os.cpu_count() or 1)))
_DRAIN_S = 0.5  # after the process ends, how long to wait for its pipes' last bytes (sandbox=none: a daemonized
# grandchild could hold them open; in bwrap mode every writer is dead once bwrap returns)
_STARTER = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="relayrl-sandbox-start")
_PROGRAM = seccomp.program()
logger = logging.getLogger(__name__)


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    duration_s: float
    truncated: bool
    network: str  # "bwrap" (own network namespace: no network) or "none" (unsandboxed: the host's network)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def text(self) -> str:
        """What a tool returns to the model."""
        parts = [self.stdout.rstrip()] if self.stdout.strip() else []
        if self.timed_out:
            parts.append(f"[timed out after {self.duration_s:.1f}s]")
        elif self.exit_code != 0:
            parts.append((self.stderr.strip().splitlines() or [f"exit code {self.exit_code}"])[-1])
        if self.truncated:
            parts.append("[output truncated]")
        return "\n".join(parts) or "[no output]"


def check_sandbox(mode: str) -> None:
    """Start-up check for a tool that will run code: raises SandboxUnavailable where `auto`/`bwrap` cannot start
    a sandbox (probing once per process), and warns loudly for `none`.

    `auto` picks the best boundary this machine has; bwrap is the only one today, so it behaves as `bwrap`.
    """
    if mode not in MODES:
        raise ValueError(f"sandbox must be one of {MODES}, got {mode!r}")
    if mode == "none":
        msg = ("UNSANDBOXED: sandbox=none runs model-written Python as a plain subprocess of this process; it can "
               "read and write your files, reach the network and the trainer's environment. Use it only with "
               "trusted models on a disposable machine.")
        logger.warning(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
        return
    bwrap.ready()


class _Gate:
    """A semaphore any event loop of the process can wait on: the cap is per process, not per loop."""

    def __init__(self, limit: int):
        self.limit, self.running = limit, 0
        self._waiters: collections.deque[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = collections.deque()
        self._lock = threading.Lock()

    async def __aenter__(self) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self.running < self.limit and not self._waiters:
                self.running += 1
                return
            waiter = (loop, loop.create_future())
            self._waiters.append(waiter)
        try:
            await waiter[1]
        except asyncio.CancelledError:
            with self._lock:
                queued = waiter in self._waiters
                if queued:
                    self._waiters.remove(waiter)
            if not queued and not waiter[1].cancelled():  # granted, then cancelled: pass the slot on
                self._release()
            raise

    async def __aexit__(self, *exc) -> None:
        self._release()

    def _release(self) -> None:
        with self._lock:
            if self._waiters and self.running <= self.limit:
                loop, fut = self._waiters.popleft()  # the slot passes over: `running` stays
                loop.call_soon_threadsafe(self._grant, fut)
            else:
                self.running -= 1

    def _grant(self, fut: asyncio.Future) -> None:
        if fut.done():  # its caller was cancelled meanwhile
            self._release()
        else:
            fut.set_result(None)

    def resize(self, limit: int) -> None:
        with self._lock:
            self.limit = limit
            grants = []
            while self._waiters and self.running < self.limit:
                self.running += 1
                grants.append(self._waiters.popleft())
        for loop, fut in grants:
            loop.call_soon_threadsafe(self._grant, fut)


_GATE = _Gate(DEFAULT_MAX_CONCURRENT)


def set_max_concurrent(limit: int) -> None:
    """The most sandboxes this process runs at once (calls beyond it wait); DEFAULT_MAX_CONCURRENT until set."""
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise ValueError(f"max_concurrent must be an integer >= 1, got {limit!r}")
    _GATE.resize(limit)


async def run_python(code: str, *, timeout: float = 5.0, memory_mb: int = 512, max_output: int = 4096,
                     file_mb: int = 16, max_procs: int = 16, sandbox: SandboxMode = "auto") -> SandboxResult:
    """Run `code` as main.py in a fresh sandbox; never raises for the code's sake (a machine with no sandbox
    raises SandboxUnavailable). `file_mb` caps each file, each writable mount (scratch, /tmp, /dev/shm) and each
    of stdout and stderr (beyond it a write fails, as past a full disk); `max_procs` caps processes and threads
    inside the sandbox. Waits for a free slot first when DEFAULT_MAX_CONCURRENT (or `set_max_concurrent`)
    sandboxes already run; `timeout` counts from the sandbox's start."""
    if sandbox not in MODES:
        raise ValueError(f"sandbox must be one of {MODES}, got {sandbox!r}")
    limits = {"memory_mb": memory_mb, "cpu_s": int(timeout) + 1, "file_mb": file_mb}
    cap = file_mb * 1024 * 1024
    async with _GATE, _Capture(max_output, cap) as out, _Capture(max_output, cap) as err:
        t0 = time.perf_counter()
        if sandbox == "none":
            exit_code = await _run_plain(code, timeout, limits, out, err)
        else:
            exit_code = await _run_bwrap(code, timeout, dict(limits, nproc=max_procs), out, err)
        duration = time.perf_counter() - t0
        await out.drained(_DRAIN_S)
        await err.drained(_DRAIN_S)
    network = "none" if sandbox == "none" else "bwrap"
    return SandboxResult(out.text(), err.text(), exit_code, exit_code is None, duration,
                         out.truncated or err.truncated, network)


class _Sink(asyncio.Protocol):
    """The reading end of one captured stream: keeps the first `keep` bytes, counts the rest, and closes the
    pipe once `cap` bytes came (the writer's next write then fails with EPIPE)."""

    def __init__(self, keep: int, cap: int):
        self.keep, self.cap, self.seen = keep, cap, 0
        self.data = bytearray()
        self.transport: asyncio.ReadTransport | None = None
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if len(self.data) < self.keep:
            self.data += data[:self.keep - len(self.data)]
        self.seen += len(data)
        if self.seen >= self.cap and self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


class _Capture:
    """stdout or stderr of one call as a pipe (`fd` is the write end to hand over, closed here once passed)."""

    def __init__(self, keep: int, cap: int):
        self.keep, self.cap = keep, cap
        self.fd = -1
        self.sink: _Sink | None = None

    async def __aenter__(self) -> _Capture:
        r, self.fd = os.pipe()
        try:
            _, self.sink = await asyncio.get_running_loop().connect_read_pipe(
                lambda: _Sink(self.keep, self.cap), os.fdopen(r, "rb", buffering=0))
        except BaseException:
            os.close(self.fd)
            raise
        return self

    def handed_over(self) -> None:
        """The child has its copy: ours must go, or the reader never sees the end of the stream."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    async def drained(self, wait: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.sink.closed), wait)

    @property
    def truncated(self) -> bool:
        return self.sink.seen > self.keep

    def text(self) -> str:
        return self.sink.data.decode(errors="replace")

    async def __aexit__(self, *exc) -> None:
        self.handed_over()
        self.sink.transport.close()


async def _run_bwrap(code: str, timeout: float, limits: dict, out: _Capture, err: _Capture) -> int | None:
    """One bwrap sandbox; the exit code, or None when it was killed at the timeout."""
    box = bwrap.ready()
    with contextlib.ExitStack() as stack:
        code_fd = _owned(stack, bwrap.memfd(code.encode(errors="replace"), "main.py"))
        sc_fd = _owned(stack, bwrap.memfd(_PROGRAM, "seccomp")) if _PROGRAM else None
        info_r, info_w = os.pipe()
        _owned(stack, info_r)
        argv = bwrap.sandbox_argv(box, **limits, code_fd=code_fd, seccomp_fd=sc_fd, info_fd=info_w)
        try:
            proc = await _spawn(argv, stdout=out.fd, stderr=err.fd, env={},
                                pass_fds=tuple(fd for fd in (code_fd, sc_fd, info_w) if fd is not None))
        finally:
            os.close(info_w)
            out.handed_over()
            err.handed_over()
        return await _wait(proc, timeout, lambda: bwrap.child_pid(info_r))


async def _run_plain(code: str, timeout: float, limits: dict, out: _Capture, err: _Capture) -> int | None:
    """sandbox=none: the same prelude and rlimits in a temporary directory, no namespaces (no process cap: the
    host-wide RLIMIT_NPROC would count every process of this user)."""
    with tempfile.TemporaryDirectory(prefix="relayrl-unsandboxed-") as work:
        Path(work, "main.py").write_bytes(code.encode(errors="replace"))
        lim = [limits["memory_mb"] * 1024 * 1024, limits["cpu_s"], limits["file_mb"] * 1024 * 1024, 0, 64, 0]
        try:
            proc = await _spawn([os.path.realpath(sys.executable), "-I", "-S", "-c", PRELUDE, *map(str, lim)],
                                cwd=work, stdout=out.fd, stderr=err.fd,
                                env={"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8"})
        finally:
            out.handed_over()
            err.handed_over()
        return await _wait(proc, timeout, lambda: None)


async def _spawn(argv: list[str], **popen) -> subprocess.Popen:
    """Start `argv` (stdin closed, a new session) on a starter thread, not the event loop's: even a vfork and
    exec costs the loop its wall time, and 50 calls started in one loop iteration add those up (docs/security.md,
    "what each limit bounds"). A call cancelled meanwhile still gets its process killed once the start returns."""
    start = functools.partial(subprocess.Popen, argv, stdin=subprocess.DEVNULL, start_new_session=True, **popen)
    started = asyncio.get_running_loop().run_in_executor(_STARTER, start)
    try:
        return await asyncio.shield(started)
    except asyncio.CancelledError:
        started.add_done_callback(_kill_started)
        raise


def _kill_started(started: asyncio.Future) -> None:
    if not started.cancelled() and started.exception() is None:
        proc = started.result()
        _kill(os.killpg, proc.pid)
        _STARTER.submit(proc.wait)


@contextlib.contextmanager
def _exit_of(proc: subprocess.Popen) -> Iterator[asyncio.Future]:
    """A future done when `proc` exits, from a pidfd the loop watches (no thread per waiting process)."""
    loop = asyncio.get_running_loop()
    fd = os.pidfd_open(proc.pid)
    exited = loop.create_future()
    loop.add_reader(fd, lambda: exited.done() or exited.set_result(None))
    try:
        yield exited
    finally:
        loop.remove_reader(fd)
        os.close(fd)


async def _wait(proc: subprocess.Popen, timeout: float, pid1) -> int | None:
    """Wait up to `timeout`; then kill the sandbox's pid 1 (its pid namespace dies with it, and bwrap returns
    only once every process in it is gone) and bwrap's process group."""
    with _exit_of(proc) as exited:
        try:
            await asyncio.wait_for(asyncio.shield(exited), timeout)
            return proc.wait()
        except TimeoutError:
            pass
        finally:
            if proc.poll() is None:
                init = pid1()
                if init is not None:
                    _kill(os.kill, init)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(asyncio.shield(exited), 2.0)
                if proc.poll() is None:  # bwrap still there (or no pid 1 known): its group, pid 1 follows
                    _kill(os.killpg, proc.pid)  # by --die-with-parent
                await exited
                proc.wait()
    return None


def _kill(fn, pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        fn(pid, signal.SIGKILL)


def _owned(stack: contextlib.ExitStack, fd: int) -> int:
    stack.callback(os.close, fd)
    return fd
