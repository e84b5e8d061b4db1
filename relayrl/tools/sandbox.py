"""Run untrusted Python (model-written tool code) in a contained subprocess.

Containment, in layers:
- its own process group in a fresh temporary working directory, killed as a group on timeout;
- resource limits: address space (memory), CPU seconds, file size, open files;
- no network: a new network namespace when the OS allows it (only loopback, down), and always a Python
  audit hook that refuses sockets;
- no writes outside the working directory, no new processes, no ctypes: refused by the same audit hook;
- a minimal environment (`python -I`, no inherited variables), stdin closed, output truncated.

The audit hook is installed before the code runs and cannot be removed from Python. It is not a
security boundary against a determined attacker with native code (that needs a container or seccomp),
but it contains the mistakes and accidents model-written code makes, which is what a rollout needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

_PRELUDE = r'''
import os, sys

def _contain(memory_mb, cpu_s, file_mb):
    """Limits first, then a private network namespace (needs ctypes, which the hook forbids later)."""
    import ctypes, resource
    mem = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_mb * 1024 * 1024,) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    try:
        return ctypes.CDLL(None, use_errno=True).unshare(0x40000000) == 0  # CLONE_NEWNET
    except Exception:
        return False

_contain(*map(int, sys.argv[1:4]))
_ROOT = os.path.realpath(os.getcwd())
_BLOCKED = {"socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.gethostbyname",
            "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.fork", "os.forkpty", "os.spawn",
            "ctypes.dlopen", "ctypes.cdata", "os.kill", "os.killpg", "pty.spawn", "resource.setrlimit",
            "resource.prlimit", "os.setuid", "os.setgid", "sys.addaudithook"}
_PATH_EVENTS = {"os.remove", "os.rmdir", "os.mkdir", "os.rename", "os.chmod", "os.chown", "os.link", "os.symlink",
                "os.truncate", "shutil.rmtree", "shutil.move", "os.utime"}

def _inside(path):
    try:
        p = os.path.realpath(os.fsdecode(path) if not isinstance(path, int) else "")
    except Exception:
        return False
    return p == _ROOT or p.startswith(_ROOT + os.sep)

def _hook(event, args):
    if event in _BLOCKED:
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open":
        path, mode, flags = args
        writing = (mode and any(c in mode for c in "wax+")) or (flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
        if writing and not isinstance(path, int) and not _inside(path):
            raise PermissionError(f"sandbox: writing {path!r} outside the working directory is not allowed")
    elif event in _PATH_EVENTS:
        for a in args[:2]:
            if isinstance(a, (str, bytes, os.PathLike)) and not _inside(a):
                raise PermissionError(f"sandbox: {event} on {a!r} outside the working directory is not allowed")

sys.addaudithook(_hook)
del _hook
__file__ = "main.py"
with open("main.py") as _f:
    _code = compile(_f.read(), "main.py", "exec")
del _f
exec(_code, {"__name__": "__main__", "__file__": "main.py"})
'''


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    duration_s: float
    truncated: bool
    network: str  # "netns" (own network namespace) or "audit-hook" (Python-level refusal only)

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


def _netns_allowed() -> bool:
    """Whether this machine lets a process take a private network namespace (root or user namespaces)."""
    global _NETNS
    if _NETNS is None:
        probe = "import ctypes, sys; sys.exit(ctypes.CDLL(None, use_errno=True).unshare(0x40000000) != 0)"
        _NETNS = subprocess.run([sys.executable, "-I", "-S", "-c", probe], capture_output=True).returncode == 0
    return _NETNS


_NETNS: bool | None = None


async def run_python(code: str, *, timeout: float = 5.0, memory_mb: int = 512, max_output: int = 4096,
                     file_mb: int = 16) -> SandboxResult:
    """Run `code` as a script in a fresh temp directory under the limits above; never raises for its sake."""
    network = "netns" if _netns_allowed() else "audit-hook"
    with tempfile.TemporaryDirectory(prefix="relayrl-sandbox-") as work:
        root = Path(work)
        (root / "main.py").write_text(code)
        (root / "_prelude.py").write_text(_PRELUDE)
        t0 = time.perf_counter()
        with open(root / ".stdout", "wb") as out, open(root / ".stderr", "wb") as err:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-I", "-S", "_prelude.py", str(memory_mb), str(int(timeout) + 1), str(file_mb),
                cwd=work, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True,
                env={"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work, "PYTHONHASHSEED": "0"})
        timed_out = False
        try:
            await asyncio.wait_for(proc.wait(), timeout)
        except TimeoutError:
            timed_out = True
        finally:
            if proc.returncode is None:
                _kill_group(proc.pid)
                await proc.wait()
        duration = time.perf_counter() - t0
        stdout, t1 = _read(root / ".stdout", max_output)
        stderr, t2 = _read(root / ".stderr", max_output)
    return SandboxResult(stdout, stderr, None if timed_out else proc.returncode, timed_out, duration, t1 or t2,
                         network)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def _read(path: Path, limit: int) -> tuple[str, bool]:
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    return data[:limit].decode(errors="replace"), len(data) > limit
