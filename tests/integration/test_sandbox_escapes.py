"""Escape attempts against the REAL sandbox (bwrap, no mocks), one class per test; each asserts containment on
the host side (canary files unchanged, listener silent, no surviving process), not only the sandbox's own view.
docs/security.md has the table of inputs tried and what each got."""

import hashlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from bounds import bound
from sandbox_helpers import Listener, host_processes_with, needs_sandbox, run

from relayrl.tools.bwrap import ready

pytestmark = needs_sandbox


def _digest(path) -> tuple[int, str]:
    st = os.stat(path)
    return st.st_mtime_ns, hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_files_outside_scratch_cannot_be_written_deleted_or_truncated(tmp_path):
    victim, outside = tmp_path / "keep.txt", tmp_path / "escape.txt"
    victim.write_text("important")
    before = _digest(victim)
    stdlib_os = os.path.join(os.path.dirname(os.__file__), "os.py")  # the host interpreter's, for reference
    attempts = {
        "open_w": f"open({str(outside)!r}, 'w').write('pwned')",
        "remove": f"os.remove({str(victim)!r})",
        "truncate": f"os.truncate({str(victim)!r}, 0)",
        "o_trunc": f"os.close(os.open({str(victim)!r}, os.O_WRONLY | os.O_TRUNC))",
        "dir_fd_unlink": f"d = os.open({str(tmp_path)!r}, os.O_RDONLY); os.unlink('keep.txt', dir_fd=d)",
        "dir_fd_trunc": f"d = os.open({str(tmp_path)!r}, os.O_RDONLY); os.open('keep.txt', os.O_WRONLY | os.O_TRUNC, "
                        "dir_fd=d)",
        "root_dir_fd": "d = os.open('/', os.O_RDONLY); os.open('pwned', os.O_WRONLY | os.O_CREAT, dir_fd=d)",
        "rmtree": f"import shutil; shutil.rmtree({str(tmp_path)!r})",
        "rename": f"os.rename({str(victim)!r}, {str(outside)!r})",
        "own_interpreter": "open(os.__file__, 'a').write('# pwned')",  # the read-only bind of the installation
        "interpreter_dir": "open(os.path.join(os.path.dirname(os.__file__), 'pwned.py'), 'w')",
        "etc": "open('/etc/pwned', 'w')",
        "proc_escape": "open('/proc/1/root/etc/pwned', 'w')",  # pid 1 is the sandbox's own init
        "chmod_root": "os.chmod('/', 0o777)",
    }
    code = "import os\nfor name, attempt in ATTEMPTS.items():\n    try:\n        exec(attempt)\n" \
           "        print(name, 'DONE')\n    except OSError as e:\n        print(name, type(e).__name__, e.errno)\n"
    host_os = _digest(stdlib_os)
    r = run(f"ATTEMPTS = {attempts!r}\n{code}")
    assert r.ok, r.stderr
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    assert set(lines) == set(attempts) and not any(v == "DONE" for v in lines.values()), r.stdout
    assert _digest(victim) == before and victim.read_text() == "important"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]
    assert _digest(stdlib_os) == host_os


def test_host_files_and_home_are_invisible(tmp_path):
    secret = f"TOPSECRET-{uuid.uuid4()}"
    shadow = tmp_path / "shadow"
    shadow.write_text(f"root:{secret}:19000:0:99999:7:::\n")
    home = tmp_path / "home"
    home.mkdir()
    (home / ".netrc").write_text(f"machine example.com password {secret}\n")
    real_home = os.path.expanduser("~")
    code = f"""import os
for p in [{str(shadow)!r}, {str(home / '.netrc')!r}, '/etc/shadow', '/etc/passwd', '/etc/hostname']:
    try:
        print(open(p).read())
    except OSError as e:
        print(p, type(e).__name__)
for d in [{str(home)!r}, {real_home!r}, os.path.expanduser('~'), '/', '/etc', '/proc/1/root']:
    try:
        print(d, sorted(os.listdir(d)))
    except OSError as e:
        print(d, type(e).__name__)
"""
    r = run(code)
    assert r.ok, r.stderr
    assert secret not in r.stdout and "FileNotFoundError" in r.stdout
    assert "/etc ['ld.so.cache']" in r.stdout  # /etc holds the loader cache only
    # the directory bwrap creates on the way to an interpreter installed under the home (~/.pyenv for
    # ~/.pyenv/versions/3.11.7) shows, as an empty mount point; nothing else of the real home may
    prefix = Path(ready().interpreter).parent.parent
    allowed = {prefix.relative_to(real_home).parts[0]} if prefix.is_relative_to(real_home) else set()
    for line in r.stdout.splitlines():
        if line.startswith(f"{real_home} ["):
            assert set(eval(line[len(real_home) + 1:])) <= allowed, line


def test_other_processes_and_the_parents_environment_are_invisible(monkeypatch):
    secret, parent_secret = f"CHILDSECRET-{uuid.uuid4()}", f"PARENTSECRET-{uuid.uuid4()}"
    monkeypatch.setenv("RELAYRL_TEST_PARENT_SECRET", parent_secret)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             env={**os.environ, "RELAYRL_TEST_SECRET": secret})
    try:
        code = f"""import os
print(dict(os.environ))
for pid in [{other.pid}, {os.getpid()}, {os.getppid()}, 1, 'self']:
    for what in ('environ', 'cmdline'):
        try:
            print(pid, what, open(f'/proc/{{pid}}/{{what}}', 'rb').read())
        except OSError as e:
            print(pid, what, type(e).__name__)
print(sorted(p for p in os.listdir('/proc') if p.isdigit()))
for p in os.listdir('/proc'):
    if p.isdigit():
        print(p, open(f'/proc/{{p}}/environ', 'rb').read())
"""
        r = run(code)
    finally:
        other.kill()
        other.wait()
    assert r.ok, r.stderr
    assert secret not in r.stdout and parent_secret not in r.stdout
    assert "'RELAYRL_TEST_PARENT_SECRET'" not in r.stdout
    visible = [line for line in r.stdout.splitlines() if line.startswith("['")]
    assert visible and eval(visible[0]) == ["1", "2"]  # its own pid namespace: bwrap's init and the script
    assert f"{other.pid} environ FileNotFoundError" in r.stdout or other.pid <= 3


@pytest.mark.parametrize("target", ["tcp_loopback", "tcp_host_ip", "abstract_unix", "dns"])
def test_network_is_unreachable(target):
    listener = Listener()
    abstract = f"\0relayrl-test-{uuid.uuid4()}"
    unix = Listener(socket.AF_UNIX, abstract) if target == "abstract_unix" else None
    host_ip = _host_ip()
    if target == "tcp_host_ip" and host_ip is None:
        listener.close()
        pytest.skip("this host has no non-loopback address")
    connect = {
        "tcp_loopback": f"s = socket.create_connection(('127.0.0.1', {listener.port}), timeout=2)",
        "tcp_host_ip": f"s = socket.create_connection(({host_ip!r}, {listener.port}), timeout=2)",
        "abstract_unix": f"s = socket.socket(socket.AF_UNIX); s.settimeout(2); s.connect({abstract!r})",
        "dns": "s = socket.create_connection(('example.com', 80), timeout=2)",
    }[target]
    r = run(f"import socket\n{connect}\ns.sendall(b'leak')\nprint('connected')", timeout=5)
    time.sleep(0.3)
    got = listener.close() + (unix.close() if unix else [])
    assert not r.ok and "connected" not in r.stdout and got == [], (r.stdout, r.stderr, got)
    assert any(e in r.stderr for e in ("ConnectionRefusedError", "Network is unreachable", "gaierror",
                                       "FileNotFoundError", "ConnectionRefused")), r.stderr


def _host_ip() -> str | None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # no packet is sent; picks the outgoing interface's address
            ip = s.getsockname()[0]
    except OSError:
        return None
    return None if ip.startswith("127.") else ip


_SLEEPER = """import os, sys, time
def sleeper():
    if os.fork() == 0:  # double fork: the grandchild is re-parented, then tries to outlive the call
        os.setsid()
        if os.fork() == 0:
            os.execv(sys.executable, [sys.executable, '-c',
                "import time, socket\\ntime.sleep(1)\\ntry:\\n    socket.create_connection(('127.0.0.1', PORT))"
                "\\nexcept OSError: pass\\ntime.sleep(60)", 'MARKER'])
        os._exit(0)
    os.wait()
sleeper()
"""


@pytest.mark.parametrize("ending", ["exits", "times_out"])
def test_no_process_outlives_the_call(ending):
    marker = f"relayrl-survivor-{uuid.uuid4()}"
    listener = Listener()
    code = _SLEEPER.replace("MARKER", marker).replace("PORT", str(listener.port))
    code += "print('started', flush=True)\n" + ("time.sleep(60)\n" if ending == "times_out" else "")
    r = run(code, timeout=1.5)
    assert r.stdout == "started\n" and r.timed_out == (ending == "times_out")
    assert host_processes_with(marker) == []
    time.sleep(1.5)  # past the moment the grandchild would have called home
    assert host_processes_with(marker) == [] and listener.close() == []


def test_fork_bomb_is_bounded():
    counted = run("import os\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            import time\n"
                  "            time.sleep(30)\n        n += 1\nexcept OSError as e:\n    print(n, e.errno)",
                  max_procs=16, timeout=10)
    n, errno_ = map(int, counted.stdout.split())
    assert counted.ok and n < 16 and errno_ == 11  # EAGAIN: RLIMIT_NPROC inside the sandbox's user namespace
    marker = f"relayrl-forkbomb-{uuid.uuid4()}"
    bomb = f"import os, sys\nos.execv(sys.executable, [sys.executable, '-c', '''\nimport os\nwhile True:\n" \
           f"    try:\n        os.fork()\n    except OSError:\n        pass\n''', '{marker}'])"
    t0 = time.perf_counter()
    r = run(bomb, timeout=2)
    assert r.timed_out and time.perf_counter() - t0 < bound(6)
    assert host_processes_with(marker) == []
    assert run("print('still fine')").stdout == "still fine\n"  # the host can still start sandboxes


def test_disk_bomb_is_bounded():
    free = shutil.disk_usage(tempfile.gettempdir()).free
    code = """import os
for where in ('/scratch', '/tmp', '/dev/shm'):
    total, i = 0, 0
    try:
        while total < 512 * 2 ** 20:
            with open(f'{where}/bomb{i}', 'wb') as f:
                for _ in range(8):
                    f.write(b'x' * 2 ** 20)
                    total += 2 ** 20
            i += 1
    except OSError as e:
        print(where, total // 2 ** 20, e.errno)
"""
    r = run(code, file_mb=8, timeout=20)
    assert r.ok, r.stderr
    for line in r.stdout.splitlines():
        where, mb, err = line.split()
        assert int(mb) <= 8 and int(err) in (27, 28), line  # EFBIG / ENOSPC at the cap
    assert len(r.stdout.splitlines()) == 3
    assert shutil.disk_usage(tempfile.gettempdir()).free > free - 256 * 2 ** 20  # nothing landed on disk
    spam = run("import sys\nwhile True:\n    sys.stdout.write('x' * 2 ** 20)", file_mb=4, max_output=4096)
    assert not spam.timed_out and spam.truncated and "Broken pipe" in spam.stderr  # stdout is capped too: a pipe
    # whose reader stops at file_mb


def test_native_code_through_ctypes_is_still_contained(tmp_path):
    canary = tmp_path / "canary"
    canary.write_text("untouched")
    code = f"""import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def call(name, *args):
    r = getattr(libc, name)(*args)
    print(name, r, ctypes.get_errno())
call('open', {str(canary).encode()!r}, os.O_WRONLY | os.O_TRUNC)
call('unshare', 0x10000000)  # CLONE_NEWUSER: refused by seccomp
call('mount', b'none', b'/', b'tmpfs', 0, None)
call('syscall', 101, 16, 1, 0, 0)  # ptrace(PTRACE_ATTACH, 1)
call('syscall', 425, 8, 0)  # io_uring_setup
call('syscall', 321, 0, 0, 0)  # bpf
call('syscall', 56, 0x10000000 | 17, 0, 0, 0, 0)  # clone(CLONE_NEWUSER | SIGCHLD): --disable-userns
status = open('/proc/self/status').read()
print('seccomp', status.split('Seccomp:')[1].split()[0], 'caps', status.split('CapEff:')[1].split()[0])
"""
    r = run(code)
    assert r.ok, r.stderr
    out = dict((line.split(" ", 1)[0], line.split(" ", 1)[1]) for line in r.stdout.splitlines())
    assert out["open"] == "-1 2"  # ENOENT: the host path does not exist in the sandbox
    assert out["unshare"] == "-1 1" and out["mount"] == "-1 1"  # EPERM
    assert canary.read_text() == "untouched"
    calls = [line for line in r.stdout.splitlines() if line.startswith("syscall")]
    assert [c.split()[1] for c in calls] == ["-1"] * 4, calls  # ptrace, io_uring, bpf, clone(NEWUSER) all fail
    assert out["seccomp"].startswith("2 caps 0000000000000000")  # filter mode, no capabilities
