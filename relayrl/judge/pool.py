"""`TimeoutPool`: worker processes whose calls can time out, so a hung call costs a worker, not the caller.

Why not `concurrent.futures.ProcessPoolExecutor`: it cannot stop a running task, so one reward function
stuck in sympy holds a worker forever, and one worker that dies breaks the whole executor. Here each
worker runs one call at a time over its own pipe; on timeout, crash or cancellation the parent SIGKILLs
that worker and starts a replacement, and every other worker carries on.

Why 'spawn' (or 'forkserver'), never 'fork': the parent holds torch/CUDA threads, and a forked child
inherits their locks in whatever state they were in.

With `memory_mb`, each worker caps its own address space (RLIMIT_AS) once its modules are loaded, so a
reward function that blows up (sympy expanding 10^10^10) fails with MemoryError in its own process instead
of the machine's OOM killer picking a victim, perhaps the trainer. A call that ends in MemoryError costs
that call; its worker is then replaced, since a process that ran out of memory mid-call may hold
half-built state. A cap that leaves less than 64 MiB above what the loaded worker already maps fails the
worker's start-up (every call would fail otherwise).

Workers start lazily (or all at once with `start()`), import `preload` modules, then report ready;
`timeout` counts only the call itself, never interpreter start-up or those imports. The function to run
is pickled by reference (or given as 'module:name'), so its module is imported in the worker on first
use. Children get the parent's sys.path through multiprocessing's preparation data, so test helper
modules are importable there too. Workers ignore SIGINT (Ctrl-C is the parent's business) and exit on
their own when the parent disappears, even if it was SIGKILLed. Under 'spawn' every worker (and every
replacement) re-imports the parent's __main__ module, as multiprocessing always does, so a script should
keep heavy work under `if __name__ == "__main__":`; 'forkserver' pays that import once.

Each worker leads its own session (process group), and a worker is killed as a group: on timeout, crash,
cancellation and `close()`, SIGKILL goes to the whole group, so a reward function that starts a child process
(a solver, a shell) and hangs, or leaves it running, leaves nothing behind. A worker whose parent died kills its
own group too. (Not PR_SET_PDEATHSIG: it fires when the *thread* that started the worker exits, and replacement
workers start from whichever thread runs the event loop.) A child that makes itself a new session escapes the
group; that is deliberate work, not an accident of a hung call.

What workers print is bounded: their stdout and stderr (file descriptors 1 and 2, so children's output too) go
through pipes that a thread in the worker drains, forwarding at most `OUTPUT_LIMIT` bytes per call to the run's
own stdout/stderr and dropping the rest with one note, so a reward function printing in a loop cannot flood the
run's console or log file.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import multiprocessing as mp
import os
import pickle
import resource
import signal
import sys
import threading
import traceback
import weakref
from collections import deque
from typing import Any

from relayrl.common import logs
from relayrl.common.imports import import_from_path


class RemoteError(Exception):
    """An exception raised by the function inside a worker, with the worker's traceback text."""

    def __init__(self, exc_type: str, message: str, remote_traceback: str):
        super().__init__(exc_type, message, remote_traceback)
        self.exc_type, self.message, self.remote_traceback = exc_type, message, remote_traceback

    def __str__(self) -> str:
        return f"{self.exc_type}: {self.message}\n\nRemote traceback:\n{self.remote_traceback}"


class WorkerCrashed(RuntimeError):
    """The worker process died (os._exit, a segfault, the OOM killer) or failed to start."""


# ---- the child side ---------------------------------------------------------------------------------
def _worker_main(conn: Any, preload: tuple[str, ...], memory_mb: int = 0) -> None:
    """Child process loop: report ready, then answer one pickled call at a time until the pipe closes."""
    with contextlib.suppress(OSError):  # EPERM only if it already leads a group, which is as good
        os.setsid()  # its own process group: killed as one with everything it starts (see the module docstring)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_when_orphaned()
    output = _BoundedOutput()
    logs.from_env()  # a reward function's log records at the run's level, in the run's format
    try:
        for module in preload:
            importlib.import_module(module)
        _limit_memory(memory_mb)
        conn.send_bytes(pickle.dumps(("ok", None)))
    except BaseException as e:
        conn.send_bytes(_error_reply(e))
        return
    resolved: dict[str, Any] = {}
    while True:
        try:
            payload = conn.recv_bytes()
        except (EOFError, OSError):
            return
        output.new_call()
        reply = _execute(payload, resolved)
        output.flush()
        conn.send_bytes(reply)


OUTPUT_LIMIT = 16 * 1024  # bytes of stdout + stderr a worker forwards per call; the rest is dropped


class _BoundedOutput:
    """Route fds 1 and 2 through pipes drained by threads that forward at most OUTPUT_LIMIT bytes per call to
    the original stdout/stderr, with one note when a call's output is cut. A thread, not a check in each write:
    the writers are anything (C extensions, children) and must never block on a full pipe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._budget, self._cut = OUTPUT_LIMIT, False
        for fd in (1, 2):
            target = os.dup(fd)
            read, write = os.pipe()
            os.dup2(write, fd)
            os.close(write)
            threading.Thread(target=self._drain, args=(read, target), name=f"output-{fd}", daemon=True).start()

    def new_call(self) -> None:
        with self._lock:
            self._budget, self._cut = OUTPUT_LIMIT, False

    @staticmethod
    def flush() -> None:
        """Push Python's buffered text into the pipes, so it counts against the call that printed it."""
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a reward function may have replaced or closed them
                stream.flush()

    def _drain(self, read: int, target: int) -> None:
        while chunk := os.read(read, 1 << 16):
            with self._lock:
                keep = chunk[: self._budget]
                self._budget -= len(keep)
                note = len(keep) < len(chunk) and not self._cut
                self._cut = self._cut or note
            with contextlib.suppress(OSError):
                if keep:
                    os.write(target, keep)
                if note:
                    os.write(target, f"\n[relayrl judge worker {os.getpid()}: output of this call cut after "
                                     f"{OUTPUT_LIMIT} bytes]\n".encode())


def _limit_memory(memory_mb: int) -> None:
    """Cap this process's address space; allocations beyond it raise MemoryError (0: no limit).

    RLIMIT_AS rather than RLIMIT_DATA: it also covers mmap, which large numpy/sympy allocations use. Set after
    the imports (spawn's bootstrap has imported most of them anyway), refused if it leaves no room for calls.
    """
    if memory_mb > 0:
        used = _mapped_mb()
        if used is not None and used + _HEADROOM_MB > memory_mb:
            raise MemoryError(f"the loaded worker already maps {used} MiB of address space: a cap of {memory_mb} "
                              f"MiB leaves less than {_HEADROOM_MB} MiB for the calls")
        limit = memory_mb * 2**20
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))


_HEADROOM_MB = 64


def _mapped_mb() -> int | None:
    """This process's address space (VmSize) in MiB, or None where /proc is not there."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") // 2**20


def _execute(payload: bytes, resolved: dict[str, Any]) -> bytes:
    """Run one call; every failure, even SystemExit or an unpicklable result, becomes an error reply."""
    try:
        fn, args, kwargs = pickle.loads(payload)
        if isinstance(fn, str):
            if fn not in resolved:
                resolved[fn] = import_from_path(fn)
            fn = resolved[fn]
        return pickle.dumps(("ok", fn(*args, **kwargs)), protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException as e:
        return _error_reply(e)


def _error_reply(e: BaseException) -> bytes:
    try:
        message = str(e)
    except Exception:
        message = "<unprintable exception>"
    return pickle.dumps(("err", type(e).__qualname__, message, traceback.format_exc()))


def _exit_when_orphaned() -> None:
    """Exit once the parent is gone, even mid-call: a SIGKILLed parent runs no atexit hooks.

    multiprocessing gives every child a sentinel pipe whose write end only the parent holds (under
    'spawn' and 'forkserver' alike), so it reads as EOF exactly when the parent dies.
    """
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        with contextlib.suppress(OSError):
            os.killpg(0, signal.SIGKILL)  # this worker's group: itself and whatever its calls started
        os._exit(1)

    threading.Thread(target=watch, name="orphan-watch", daemon=True).start()


# ---- the parent side --------------------------------------------------------------------------------
class _Worker:
    """One child process and the parent's end of its pipe."""

    def __init__(self, ctx: Any, preload: tuple[str, ...], name: str, memory_mb: int = 0):
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(child, preload, memory_mb), name=name, daemon=True)
        self.proc.start()
        child.close()  # else our copy keeps the pipe open and a dead worker never reads as EOF
        self.ready = False

    def send(self, payload: bytes) -> None:
        try:
            self.conn.send_bytes(payload)
        except OSError:
            raise WorkerCrashed(self.death_note()) from None

    async def receive(self, timeout: float | None) -> tuple:
        if not self.conn.poll():
            await _readable(self.conn, timeout)
        try:
            return pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError):
            raise WorkerCrashed(self.death_note()) from None

    def death_note(self) -> str:
        self.proc.join(timeout=0.5)  # EOF on the pipe means it is exiting: only wait for the exit code
        pid, code = self.proc.pid, self.proc.exitcode
        if code is None:
            return f"worker pid {pid} closed its pipe"
        if code < 0:
            name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
            return f"worker pid {pid} was killed by {name}"
        return f"worker pid {pid} exited with code {code}"

    def kill(self) -> None:
        """SIGKILL the worker's process group (its children too, even after the worker itself died), then the
        worker in case it had not made its group yet."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5.0)  # SIGKILL is immediate; this only reaps the zombie
        self.conn.close()


async def _readable(conn: Any, timeout: float | None) -> None:
    """Wait until the pipe has data or EOF, without a thread per pending call."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    fd = conn.fileno()
    loop.add_reader(fd, lambda: fut.done() or fut.set_result(None))
    try:
        async with asyncio.timeout(timeout):
            await fut
    finally:
        loop.remove_reader(fd)


def _kill_all(slots: list[_Worker | None]) -> None:
    for i, w in enumerate(slots):
        if w is not None:
            w.kill()
            slots[i] = None


def _label(fn: Any) -> str:
    return fn if isinstance(fn, str) else getattr(fn, "__qualname__", repr(fn))


class TimeoutPool:
    """`workers` processes, one call each at a time; calls beyond that wait (FIFO) for a free worker.

    Use from coroutines of one event loop at a time (a later `asyncio.run` may use it again once the
    earlier loop's calls are over). `close()` (also on exit, or via `with`) kills every worker.
    `memory_mb` > 0 caps each worker's address space (see the module docstring).
    """

    def __init__(self, workers: int = 2, *, preload: tuple[str, ...] | list[str] = (),
                 context: str = "spawn", start_timeout: float = 120.0, name: str = "relayrl-pool",
                 memory_mb: int = 0):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if memory_mb < 0:
            raise ValueError(f"memory_mb must be >= 0 (0: no limit), got {memory_mb}")
        self.memory_mb = memory_mb
        if context not in ("spawn", "forkserver"):
            raise ValueError(f"context {context!r}: use 'spawn' or 'forkserver' (fork is unsafe with torch)")
        self._ctx = mp.get_context(context)
        self.preload = tuple(preload)
        self.start_timeout = start_timeout
        self.name = name
        self._slots: list[_Worker | None] = [None] * workers
        self._idle: deque[int] = deque(range(workers))
        self._waiters: deque[asyncio.Future[int]] = deque()
        self._closed = False
        self._finalizer = weakref.finalize(self, _kill_all, self._slots)  # also runs at interpreter exit

    @property
    def size(self) -> int:
        return len(self._slots)

    def worker_pids(self) -> list[int]:
        """Pids of the live workers (for monitoring and tests)."""
        return [w.proc.pid for w in self._slots if w is not None and w.proc.is_alive()]

    def start(self) -> None:
        """Start every worker now, so their start-up overlaps other work instead of the first calls."""
        self._check_open()
        for i, w in enumerate(self._slots):
            if w is None:
                self._slots[i] = self._spawn(i)

    def wait_ready(self) -> None:
        """Block until every started worker has finished start-up (raises WorkerCrashed if one failed).

        Call it before the event loop uses the pool: it reads the workers' ready messages directly.
        """
        for slot, w in enumerate(self._slots):
            if w is None or w.ready:
                continue
            if not w.conn.poll(self.start_timeout):
                self._discard(slot, respawn=False)
                raise WorkerCrashed(f"{self.name} worker not ready within {self.start_timeout:g}s")
            try:
                reply = pickle.loads(w.conn.recv_bytes())
            except (EOFError, OSError):
                raise WorkerCrashed(f"{self.name} worker failed to start: {w.death_note()}") from None
            if reply[0] != "ok":
                self._discard(slot, respawn=False)
                raise WorkerCrashed(f"{self.name} worker failed to start: {RemoteError(*reply[1:])}")
            w.ready = True

    async def run(self, fn: Any, /, *args: Any, timeout: float | None, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` in a worker; see `call`."""
        return await self.call(fn, args, kwargs, timeout=timeout)

    async def call(self, fn: Any, args: tuple = (), kwargs: dict[str, Any] | None = None, *,
                   timeout: float | None) -> Any:
        """Run `fn` (a module-level function, or 'module:name') in a free worker and return its result.

        Raises TimeoutError after `timeout` seconds (the worker is killed and replaced), RemoteError if
        `fn` raised, WorkerCrashed if the worker died. `kwargs` is a dict so it may hold any key, even
        'timeout'. Cancelling the calling task also kills the worker: its half-done call cannot be reused.
        """
        self._check_open()
        try:
            payload = pickle.dumps((fn, tuple(args), dict(kwargs or {})), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            raise TypeError(f"cannot send {_label(fn)} and its arguments to a worker process: {e}") from e
        slot = await self._acquire()
        try:
            worker = await self._ready(slot)
            reply = await self._dispatch(slot, worker, payload, timeout, _label(fn))
        finally:
            self._release(slot)
        if reply[0] == "ok":
            return reply[1]
        raise RemoteError(*reply[1:])

    def run_sync(self, fn: Any, /, *args: Any, timeout: float | None, **kwargs: Any) -> Any:
        """Blocking `run` for scripts and REPLs; not from inside a running event loop."""
        return asyncio.run(self.call(fn, args, kwargs, timeout=timeout))

    def close(self) -> None:
        """Kill every worker; pending and later calls fail. Safe to call twice."""
        self._closed = True
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done() and not w.get_loop().is_closed():
                w.set_exception(RuntimeError(f"{self.name} was closed"))
        self._finalizer()

    def __enter__(self) -> TimeoutPool:  # `with` works inside coroutines too: close() never awaits
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self.name} is closed")

    def _spawn(self, slot: int) -> _Worker:
        return _Worker(self._ctx, self.preload, f"{self.name}-{slot}", self.memory_mb)

    async def _acquire(self) -> int:
        if self._idle:
            return self._idle.popleft()
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._release(fut.result())  # handed a worker just as we were cancelled: pass it on
            raise

    def _release(self, slot: int) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(slot)
                return
        self._idle.append(slot)

    def _discard(self, slot: int, respawn: bool) -> None:
        """Kill the slot's worker; start its replacement now so it warms up before it is needed."""
        w, self._slots[slot] = self._slots[slot], None
        if w is not None:
            w.kill()
        if respawn and not self._closed:
            self._slots[slot] = self._spawn(slot)

    async def _ready(self, slot: int) -> _Worker:
        """The slot's worker, started if needed and past its start-up (not counted in call timeouts)."""
        self._check_open()
        w = self._slots[slot]
        if w is None or not w.proc.is_alive():  # never started, or died while idle
            self._discard(slot, respawn=True)
            w = self._slots[slot]
        assert w is not None
        if not w.ready:  # a cancellation here leaves it starting; the next caller waits for it instead
            try:
                reply = await w.receive(self.start_timeout)
            except (TimeoutError, WorkerCrashed) as e:
                self._discard(slot, respawn=False)
                why = str(e) or f"not ready within {self.start_timeout:g}s"
                raise WorkerCrashed(f"{self.name} worker failed to start: {why}") from None
            if reply[0] != "ok":
                self._discard(slot, respawn=False)
                raise WorkerCrashed(f"{self.name} worker failed to start: {RemoteError(*reply[1:])}")
            w.ready = True
        return w

    async def _dispatch(self, slot: int, w: _Worker, payload: bytes, timeout: float | None,
                        label: str) -> tuple:
        """Send one call and wait for its reply; anything but a reply leaves the worker unusable, and so
        does a MemoryError reply (the worker may hold half-built state): both get a fresh worker."""
        reusable = False
        try:
            w.send(payload)
            reply = await w.receive(timeout)
            reusable = reply[0] == "ok" or reply[1] != "MemoryError"
            return reply
        except TimeoutError:
            raise TimeoutError(f"{label} did not finish within {timeout:g}s; its worker was killed") from None
        except WorkerCrashed as e:
            raise WorkerCrashed(f"{e} while running {label}") from None
        finally:
            if not reusable:
                self._discard(slot, respawn=True)
