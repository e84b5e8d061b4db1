"""Run untrusted Python (model-written tool code) behind an OS boundary: bubblewrap namespaces.

Model-written code is treated as hostile. Each call runs in a fresh bwrap sandbox (relayrl/tools/bwrap.py;
threat model, flags and the escape attempts tried in docs/security.md):
- its own user, pid, network, ipc, uts and cgroup namespaces: it sees only its own processes, has no network
  (a private loopback), and cannot create further user namespaces;
- a read-only root holding only the system libraries and the Python installation, a fresh /proc of its pid
  namespace, a minimal /dev, size-capped tmpfs mounts for /scratch (its working directory), /tmp and /dev/shm;
- an empty environment (PATH, HOME=/scratch, TMPDIR, LANG), stdin closed, a new session (no terminal);
- rlimits set inside before the code runs: address space, CPU seconds, file size, processes, open files;
- a seccomp deny-list of rarely needed, often exploited syscalls (relayrl/tools/seccomp.py);
- a wall-clock kill of the sandbox's pid 1, which takes every process of the sandbox with it.

`sandbox="none"` runs the same code as a plain subprocess with the same rlimits (no namespaces): only for
machines where no boundary can start, only when the user writes it, and warned about at start-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

from relayrl.tools import bwrap, seccomp
from relayrl.tools.bwrap import PRELUDE, SandboxUnavailable

__all__ = ["MODES", "SandboxMode", "SandboxResult", "SandboxUnavailable", "check_sandbox", "run_python"]
SandboxMode = Literal["auto", "bwrap", "none"]
MODES = ("auto", "bwrap", "none")
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


async def run_python(code: str, *, timeout: float = 5.0, memory_mb: int = 512, max_output: int = 4096,
                     file_mb: int = 16, max_procs: int = 16, sandbox: SandboxMode = "auto") -> SandboxResult:
    """Run `code` as main.py in a fresh sandbox; never raises for the code's sake (a machine with no sandbox
    raises SandboxUnavailable). `file_mb` caps each file and each writable mount (scratch, /tmp, /dev/shm);
    `max_procs` caps processes and threads inside the sandbox."""
    if sandbox not in MODES:
        raise ValueError(f"sandbox must be one of {MODES}, got {sandbox!r}")
    limits = {"memory_mb": memory_mb, "cpu_s": int(timeout) + 1, "file_mb": file_mb}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        if sandbox == "none":
            exit_code = await _run_plain(code, timeout, limits, out, err)
        else:
            exit_code = await _run_bwrap(code, timeout, dict(limits, nproc=max_procs), out, err)
        duration = time.perf_counter() - t0
        stdout, t1 = _read(out, max_output)
        stderr, t2 = _read(err, max_output)
    network = "none" if sandbox == "none" else "bwrap"
    return SandboxResult(stdout, stderr, exit_code, exit_code is None, duration, t1 or t2, network)


async def _run_bwrap(code: str, timeout: float, limits: dict, out: IO[bytes], err: IO[bytes]) -> int | None:
    """One bwrap sandbox; the exit code, or None when it was killed at the timeout."""
    box = bwrap.ready()
    program = seccomp.program()
    with contextlib.ExitStack() as stack:
        code_fd = _owned(stack, bwrap.memfd(code.encode(errors="replace"), "main.py"))
        sc_fd = _owned(stack, bwrap.memfd(program, "seccomp")) if program else None
        info_r, info_w = os.pipe()
        _owned(stack, info_r)
        argv = bwrap.sandbox_argv(box, **limits, code_fd=code_fd, seccomp_fd=sc_fd, info_fd=info_w)
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=err, env={}, start_new_session=True,
                pass_fds=tuple(fd for fd in (code_fd, sc_fd, info_w) if fd is not None), **box.popen_kwargs())
        finally:
            os.close(info_w)
        return await _wait(proc, timeout, lambda: bwrap.child_pid(info_r))


async def _run_plain(code: str, timeout: float, limits: dict, out: IO[bytes], err: IO[bytes]) -> int | None:
    """sandbox=none: the same prelude and rlimits in a temporary directory, no namespaces (no process cap: the
    host-wide RLIMIT_NPROC would count every process of this user)."""
    with tempfile.TemporaryDirectory(prefix="relayrl-unsandboxed-") as work:
        Path(work, "main.py").write_bytes(code.encode(errors="replace"))
        lim = [limits["memory_mb"] * 1024 * 1024, limits["cpu_s"], limits["file_mb"] * 1024 * 1024, 0, 64, 0]
        proc = await asyncio.create_subprocess_exec(
            os.path.realpath(sys.executable), "-I", "-S", "-c", PRELUDE, *map(str, lim), cwd=work,
            stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True,
            env={"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8"})
        return await _wait(proc, timeout, lambda: None)


async def _wait(proc: asyncio.subprocess.Process, timeout: float, pid1) -> int | None:
    """Wait up to `timeout`; then kill the sandbox's pid 1 (its pid namespace dies with it, and bwrap returns
    only once every process in it is gone) and bwrap's process group."""
    try:
        return await asyncio.wait_for(proc.wait(), timeout)
    except TimeoutError:
        pass
    finally:
        if proc.returncode is None:
            init = pid1()
            if init is not None:
                _kill(os.kill, init)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(proc.wait()), 2.0)
            if proc.returncode is None:  # bwrap still there (or no pid 1 known): its group, pid 1 follows
                _kill(os.killpg, proc.pid)  # by --die-with-parent
            await proc.wait()
    return None


def _kill(fn, pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        fn(pid, signal.SIGKILL)


def _owned(stack: contextlib.ExitStack, fd: int) -> int:
    stack.callback(os.close, fd)
    return fd


def _read(f: IO[bytes], limit: int) -> tuple[str, bool]:
    f.seek(0)
    data = f.read(limit + 1)
    return data[:limit].decode(errors="replace"), len(data) > limit
