"""Host resources a tool reaches past its rlimits, against the REAL sandbox: shared memory, tmpfs inodes, the
captured output as a host file, the sandbox start's cost to the event loop, concurrent calls. Each test fails
when its bound is gone (docs/security.md, "what each limit bounds")."""

import asyncio
import os
import platform
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest
from sandbox_helpers import needs_sandbox, run

from relayrl.common.errors import InputError
from relayrl.tools import bwrap, python_tool, run_python, sandbox
from relayrl.tools.bwrap import FILES_PER_MOUNT, WRITABLE, ready

pytestmark = needs_sandbox

_MQ_OPEN = {"x86_64": 240, "aarch64": 180}.get(platform.machine())
_IPC = """import ctypes
libc = ctypes.CDLL(None, use_errno=True)
def call(name, *args):
    print(name, getattr(libc, name)(*args), ctypes.get_errno())
call('shmget', 0, 256 << 20, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600: 256 MB that RLIMIT_AS does not count
call('shmget', HOST_KEY, 0, 0)  # the host's segment
call('semget', 0, 1000, 0o1600)
call('msgget', 0, 0o1600)
if MQ_OPEN:
    print('mq_open', libc.syscall(MQ_OPEN, b'q', 0o102, 0o600, None), ctypes.get_errno())
print('segments', open('/proc/sysvipc/shm').read().count(chr(10)) - 1)
"""


def test_system_v_ipc_is_refused_and_the_hosts_is_invisible():
    libc = __import__("ctypes").CDLL(None, use_errno=True)
    key = 0x52000000 | (os.getpid() & 0xFFFF)
    shmid = libc.shmget(key, 4096, 0o1600)
    assert shmid >= 0
    try:
        host_before = Path("/proc/sysvipc/shm").read_text()
        r = run(_IPC.replace("HOST_KEY", str(key)).replace("MQ_OPEN", str(_MQ_OPEN or 0)))
        host_after = Path("/proc/sysvipc/shm").read_text()
    finally:
        libc.shmctl(shmid, 0, None)  # IPC_RMID
    assert r.ok, r.stderr
    out = {line.split()[0]: line.split()[1:] for line in r.stdout.splitlines()}
    for name in ("shmget", "semget", "msgget") + (("mq_open",) if _MQ_OPEN else ()):
        assert out[name] == ["-1", "1"], (name, r.stdout)  # EPERM from the seccomp filter
    assert out["segments"] == ["0"]  # its own IPC namespace: the host's segment is not listed
    assert host_before == host_after


def test_posix_shared_memory_is_the_sandboxs_own_capped_tmpfs():
    host_name = f"relayrl-host-{uuid.uuid4()}"
    jail_name = f"relayrl-jail-{uuid.uuid4()}"
    host_shm = Path("/dev/shm")
    (host_shm / host_name).write_bytes(b"host")
    code = f"""import os, time
from multiprocessing import shared_memory
print(sorted(os.listdir('/dev/shm')))
m = shared_memory.SharedMemory(name={jail_name!r}, create=True, size=1 << 20)
m.buf[0] = 1
print('created', flush=True)
try:
    with open('/dev/shm/big', 'wb') as f:
        f.write(b'x' * (8 << 20))
except OSError as e:
    print('big', e.errno)
time.sleep(0.6)
m.close()
"""
    seen: list[list[str]] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.append(os.listdir(host_shm))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        r = run(code, file_mb=4)
    finally:
        stop.set()
        watcher.join()
        (host_shm / host_name).unlink()
    assert r.ok, r.stderr
    lines = r.stdout.splitlines()
    assert host_name not in lines[0] and lines[1] == "created"
    assert lines[2] in ("big 27", "big 28")  # EFBIG / ENOSPC: the 4 MB cap holds for /dev/shm too
    assert seen and not any(jail_name in names for names in seen)


def test_writable_mounts_have_an_inode_limit():
    code = f"""import os
for where in {WRITABLE!r}:
    n = 0
    try:
        while n < {FILES_PER_MOUNT} + 1000:
            os.mkdir(f'{{where}}/d{{n}}')
            n += 1
    except OSError as e:
        print(where, n, e.errno, os.statvfs(where).f_files)
"""
    r = run(code, timeout=20)
    assert r.ok, r.stderr
    lines = [line.split() for line in r.stdout.splitlines()]
    assert [line[0] for line in lines] == list(WRITABLE), r.stdout
    for where, n, errno_, files in lines:
        assert int(n) < FILES_PER_MOUNT and errno_ == "28" and int(files) == FILES_PER_MOUNT, (where, n, errno_)


def test_output_is_a_pipe_that_cannot_reserve_host_disk():
    code = """import ctypes, os, stat
libc = ctypes.CDLL(None, use_errno=True)
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
for fd in (1, 2):
    print(fd, stat.S_ISFIFO(os.fstat(fd).st_mode), libc.fallocate(fd, 1, 0, 768 << 20), ctypes.get_errno())
    try:
        os.posix_fallocate(fd, 0, 768 << 20)
        print(fd, 'posix_fallocate DONE')
    except OSError as e:
        print(fd, 'posix_fallocate', e.errno)
try:  # reopened through /proc: still the pipe, when it opens at all
    with open('/proc/self/fd/1', 'ab') as f:
        print('reopened', stat.S_ISFIFO(os.fstat(f.fileno()).st_mode))
except OSError as e:
    print('reopened', e.errno)
"""
    r = run(code)
    assert r.ok, r.stderr
    lines = r.stdout.splitlines()
    assert lines[:4] == ["1 True -1 29", "1 posix_fallocate 29", "2 True -1 29", "2 posix_fallocate 29"]  # ESPIPE
    assert lines[4] in ("reopened True", "reopened 13")


def test_a_large_parent_heap_does_not_make_sandbox_starts_cost_the_event_loop():
    """With Popen's user/group (as root) every start forked the whole heap, holding the GIL: the process's CPU
    time per call grew with the heap (on any thread). Measured as CPU time, which a busy machine does not skew."""
    heap = bytearray(1 << 30)
    heap[::4096] = b"\1" * len(range(0, len(heap), 4096))  # touched: the pages (and their tables) exist
    t0 = time.process_time()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    fork_cpu = time.process_time() - t0
    os.waitpid(pid, 0)

    async def calls(n: int) -> float:
        await run_python("print(1)")
        t = time.process_time()
        results = await asyncio.gather(*(run_python("print(1)") for _ in range(n)))
        assert all(r.stdout == "1\n" for r in results)
        return (time.process_time() - t) / n

    per_call = asyncio.run(calls(8))
    del heap
    print(f"CPU per call {per_call * 1000:.1f} ms, one fork of the heap {fork_cpu * 1000:.1f} ms")
    assert per_call < fork_cpu / 2, (per_call, fork_cpu)


@pytest.fixture
def cap_of_two():
    sandbox.set_max_concurrent(2)
    yield
    sandbox.set_max_concurrent(sandbox.DEFAULT_MAX_CONCURRENT)


def test_concurrent_calls_are_capped_across_event_loops(cap_of_two):
    code = "import time\nt = time.time()\ntime.sleep(0.3)\nprint(t, time.time())"
    spans: list[tuple[float, float]] = []

    async def calls(n: int) -> None:
        running = asyncio.gather(*(run_python(code) for _ in range(n)))
        await asyncio.sleep(0.05)
        waiting = asyncio.ensure_future(run_python(code))  # cancelled while it waits for a slot
        await asyncio.sleep(0.05)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        spans.extend(tuple(map(float, r.stdout.split())) for r in await running)

    threads = [threading.Thread(target=asyncio.run, args=(calls(3),)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(spans) == 6
    most = max(sum(a <= t < b for a, b in spans) for t, _ in spans)
    assert most <= 2, sorted(spans)
    assert sandbox._GATE.running == 0  # every slot came back, the cancelled call's too
    assert run("print('after')").stdout == "after\n"


def test_max_concurrent_tool_option():
    with pytest.raises(InputError, match="tool_options.python.max_concurrent: .*>= 1, got 0"):
        python_tool(max_concurrent=0)
    try:
        python_tool(max_concurrent=3)
        assert sandbox._GATE.limit == 3
    finally:
        sandbox.set_max_concurrent(sandbox.DEFAULT_MAX_CONCURRENT)


def test_the_interpreter_drops_to_nobody_where_setpriv_is_missing():
    box = ready()
    if box.user is None:
        pytest.skip("only as root does bwrap start through a dropper")
    no_setpriv = bwrap.Box(box.binary, box.interpreter, box.user,
                           bwrap.dropper(box.user, box.interpreter, use_setpriv=False))
    code_fd = bwrap.memfd(b"import os\nprint(os.getuid(), os.getpid())", "main.py")
    try:
        argv = bwrap.sandbox_argv(no_setpriv, memory_mb=256, cpu_s=5, file_mb=1, nproc=8, code_fd=code_fd,
                                  seccomp_fd=None)
        r = subprocess.run(argv, capture_output=True, text=True, timeout=30, pass_fds=(code_fd,), env={})
    finally:
        os.close(code_fd)
    assert argv[0] == box.interpreter and r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(box.user), "2"]
