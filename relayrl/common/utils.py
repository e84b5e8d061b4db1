"""Small shared helpers: import by path, atomic writes."""

from __future__ import annotations

import ctypes
import functools
import importlib
import json
import os
import pickle
import resource
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

PICKLE_SCHEME = "pickle:"  # "pickle:/abs/path/obj.pkl": an object saved by value (relayrl.api), see below


def import_from_path(spec: str) -> Any:
    """Resolve 'package.module:Name' (or 'package.module.Name') to the named object.

    This is how a config names user code: an agent, a reward function, a dataset or a filter. It also reads
    'pickle:/path/to/obj.pkl', an object relayrl.api saved by value (cloudpickle) because no import path reaches
    it (a notebook's or a script's __main__, a lambda, a closure): every loader, the judge's worker processes
    included, resolves it here, so none needs to know. Loading a pickle runs code, as importing a module does: a
    config is trusted either way.
    """
    if spec.startswith(PICKLE_SCHEME) and spec.endswith(".pkl"):  # never an attribute path: "pkl" follows a dot
        return _unpickle(spec[len(PICKLE_SCHEME):])
    if ":" in spec:
        mod_name, _, attr = spec.partition(":")
    else:
        mod_name, _, attr = spec.rpartition(".")
    if not mod_name or not attr:
        raise ValueError(f"import path {spec!r} must look like 'package.module:Name'")
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise ImportError(f"cannot import module {mod_name!r} named by {spec!r}: {e}") from e
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ImportError(f"module {mod_name!r} has no attribute {attr!r} (named by {spec!r})")
        obj = getattr(obj, part)
    return obj


@functools.cache
def _unpickle(path: str) -> Any:
    """The object in a 'pickle:' file, loaded once per process, so that every resolution of one path gives the
    same object (as an import does: caches keyed by the object, identity checks)."""
    try:
        with open(path, "rb") as f:
            return pickle.load(f)  # a cloudpickle file: it imports cloudpickle's helpers itself
    except OSError as e:
        raise ImportError(f"cannot read the pickled object {path!r}: {e}") from e


def module_level_path(obj: Any) -> str | None:
    """'module:name' of an object bound at the top level of the module named by its `__module__` (a configured
    reward function such as `helpful = llm_judge(...)`, which has no __qualname__ of its own), or None."""
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    name = next((k for k, v in vars(module).items() if v is obj), None) if module is not None else None
    return None if name is None else f"{module.__name__}:{name}"


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write a file so that a crash leaves either the old or the new content, never half of it."""
    atomic_write_bytes(path, text.encode())


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """`atomic_write_text` for bytes: temp file in the same folder, fsync, rename over the target."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; results are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class InputError(ValueError):
    """A user-supplied file or value is unusable; the message names the file and line (or the key), so the
    CLI prints it without a traceback."""


def install_hint(extra: str) -> str:
    """How to add one of pyproject.toml's extras. relayrl is installed from its checkout (scripts/setup.sh,
    editable) until it is published, so `pip install relayrl[x]` would find nothing: every hint says this."""
    return f"pip install -e '.[{extra}]' in the relayrl checkout"


def check_writable(path: str | os.PathLike, key: str) -> None:
    """Create `path` and write a file in it, so an unwritable folder fails before compute is spent;
    the error names the config key that chose the folder."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        (path / ".write_test").write_text("ok")
        (path / ".write_test").unlink()
    except OSError as e:
        raise OSError(f"{key}: cannot write to {path}: {e}") from e


def append_jsonl(path: str | os.PathLike, record: dict[str, Any]) -> None:
    """Append one JSON line with a single write() so a crash never leaves a half line behind.

    A line is written whole by one O_APPEND write; a torn final line (no trailing newline) from an
    earlier crash is skipped by `read_jsonl`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(record, ensure_ascii=False) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Read complete JSON lines; an unterminated last line (a crash mid-write) is ignored."""
    out = []
    with open(path) as f:
        for line in f:
            if line.endswith("\n") and line.strip():
                out.append(json.loads(line))
    return out


@functools.cache
def _omp_pause():
    """omp_pause_resource_all of the libgomp torch loaded (never a second copy of the runtime), or None."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    path = next((f for f in (line.split()[-1] for line in maps.splitlines()) if "libgomp" in f and f[:1] == "/"), None)
    if path is None:
        return None
    fn = getattr(ctypes.CDLL(path), "omp_pause_resource_all", None)
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return fn


def release_openmp_threads() -> None:
    """Let the calling thread's OpenMP workers exit before it waits while another thread computes.

    Each Python thread that runs torch ops owns an OpenMP team. Once libgomp manages more threads than there
    are CPUs (the engine's worker and the trainer's thread, two teams of two on two cores), it stops spinning
    between parallel regions and every small op pays a futex wake-up, which makes elementwise ops several times
    slower and costs a decode step much of its time (docs/benchmarks.md, "Rollout speed"). A thread about to wait
    gives its team back; its next op builds a new one, a one-off cost far below a wake-up per op.
    Called only by a thread about to block (LocalEngine's creator, Env.run), never under a lock.
    """
    import torch  # noqa: F401 - libgomp is torch's; load it before looking for it

    pause = _omp_pause()
    if pause is not None:
        pause(1)  # omp_pause_soft


# ---- glibc malloc --------------------------------------------------------------------------------------------
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:  # not glibc (musl, macOS): their allocators behave differently; nothing to tune
        return None


@functools.cache
def tune_allocator() -> None:
    """Set glibc malloc for a training process; call before any thread allocates (a no-op off glibc).

    One arena (RELAYRL_MALLOC_ARENAS, default 1; 0 keeps glibc's default, 8 per core): glibc gives each thread
    that allocates under contention its own heap, and one heap's freed pages are no use to another, so the
    engine's worker thread and the trainer's thread each kept their own high-water mark, and the peaks add up
    (docs/benchmarks.md, "The whole job, phase by phase"). A MALLOC_ARENA_MAX the user exported wins.

    Opt-in (RELAYRL_MMAP_THRESHOLD=BYTES): give every allocation of at least BYTES its own mapping. glibc's
    threshold rises (up to 32 MB) each time a mapped block is freed, so a step's activations (blocks of tens of
    MB) land in heaps that keep their freed holes; a fixed threshold returns them at once but every such block then
    pays fresh page faults. With it, torch is asked for transparent huge pages on its large tensors
    (THP_MEM_ALLOC_ENABLE, read once by torch's allocator, so only when torch is not imported yet and the
    variable is unset): one fault per 2 MB instead of 512. It trades step time for a lower peak
    (docs/benchmarks.md, "Scaling with model size"), and huge pages win back part of the time.
    Unset, it is decided per run once the trainer knows its size (`fit_allocator_to`); 0 keeps it off.
    `trim_memory` between phases gives the held memory back; once per phase, the page faults it causes are few.

    Also bounds oneDNN's two kernel caches (`bound_onednn_caches`), on any platform.
    """
    bound_onednn_caches()
    libc = _glibc()
    if libc is None:
        return
    arenas = int(os.environ.get("RELAYRL_MALLOC_ARENAS", "1"))
    if arenas > 0 and "MALLOC_ARENA_MAX" not in os.environ:
        libc.mallopt(_M_ARENA_MAX, arenas)
    threshold = int(os.environ.get("RELAYRL_MMAP_THRESHOLD") or "0")
    if threshold > 0:
        libc.mallopt(_M_MMAP_THRESHOLD, threshold)
        libc.mallopt(_M_TRIM_THRESHOLD, 2 * threshold)
        if "torch" not in sys.modules:
            os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


AUTO_MMAP_THRESHOLD = 1 << 20  # what fit_allocator_to sets: blocks of 1 MiB and more get their own mapping
# memory is "tight" when the training floor (training_floor: 16 bytes per fp32 parameter) is at least this share of
# the memory that holds it: a step without the memory settings reaches several times its floor (docs/benchmarks.md,
# "Scaling with model size")
TIGHT_FLOOR_SHARE = 0.2


def training_floor(params: Iterable[Any]) -> tuple[int, int]:
    """(bytes, parameters) of the trainable `params`' floor: weights, gradients and two AdamW moments, all in the
    weights' dtype: 16 bytes per fp32 parameter, 8 per bf16 one (model.train_dtype). Moments kept in bf16 under
    fp32 weights (train.optimizer_state_dtype) are a saving below this floor, not a lower floor."""
    params = [p for p in params if p.requires_grad]
    return sum(4 * p.element_size() * p.numel() for p in params), sum(p.numel() for p in params)


def memory_is_tight(floor_bytes: int, total_bytes: int | None) -> bool:
    """Whether a run with this floor should trade a little speed for memory (model.gradient_checkpointing "auto",
    fit_allocator_to): yes when the floor is at least TIGHT_FLOOR_SHARE of `total_bytes` (None: unknown, no)."""
    return bool(total_bytes) and floor_bytes >= TIGHT_FLOOR_SHARE * total_bytes


def checkpointing_on(setting: bool | str, floor_bytes: int, total_bytes: int | None) -> bool:
    """model.gradient_checkpointing as a trainer applies it: "auto" -> `memory_is_tight`, else the setting."""
    return memory_is_tight(floor_bytes, total_bytes) if setting == "auto" else bool(setting)


def fit_allocator_to(floor_bytes: int) -> str:
    """Fix glibc's mmap threshold at 1 MiB when this process's training floor (16 bytes per trainable parameter)
    is a large share of the machine's RAM (`memory_is_tight`) and RELAYRL_MMAP_THRESHOLD is unset; say what the
    allocator does now.

    Why a rule and not a default: the threshold takes the heap's retention of freed activations away (a lower
    peak relative to the floor) but every large block then pays fresh page faults, a step-time cost that is
    largest for small models (docs/benchmarks.md, "Scaling with model size"). Where the floor is small next to the
    RAM (the README job) memory is not what limits the run and the time is kept; where it is large, the retention
    (a sizeable fraction of the floor) decides whether the run fits. Set after torch is loaded, so without the
    huge pages tune_allocator asks for (they recover part of the cost only for small models). Applies to the blocks
    allocated from now on: the activations of training.
    """
    setting = os.environ.get("RELAYRL_MMAP_THRESHOLD") or ""
    libc = _glibc()
    if libc is None:
        return "the system's allocator (not glibc: nothing to tune)"
    if setting:
        threshold = int(setting)
        return (f"blocks >= {threshold} bytes mapped on their own (RELAYRL_MMAP_THRESHOLD)" if threshold > 0
                else "glibc's heap (RELAYRL_MMAP_THRESHOLD=0)")
    if not memory_is_tight(floor_bytes, mem_total_bytes()):
        return "glibc's heap (auto)"
    libc.mallopt(_M_MMAP_THRESHOLD, AUTO_MMAP_THRESHOLD)
    libc.mallopt(_M_TRIM_THRESHOLD, 2 * AUTO_MMAP_THRESHOLD)
    return "freed blocks >= 1 MiB go back to the OS at once (auto; RELAYRL_MMAP_THRESHOLD=0 for glibc's heap)"


def mem_total_bytes() -> int | None:
    """The machine's RAM (MemTotal of /proc/meminfo), or None where there is no such file."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


ONEDNN_CACHE_CAPACITY = 128  # kernels kept per cache: a step's distinct bf16 matmul shapes, with room


def bound_onednn_caches() -> None:
    """Keep at most ONEDNN_CACHE_CAPACITY kernels in each of oneDNN's caches (its primitive cache and ideep's).

    On a CPU every bf16 matmul (autocast, a bf16 engine) runs through a oneDNN kernel built for its exact shape
    and kept in two caches of 1024 entries each. Training shapes follow each micro-batch's token count, so they
    rarely repeat across steps: every step adds new shapes, and the heap grows step after step until both caches
    are full, hundreds of MB later (docs/benchmarks.md, "bf16 autocast by default where it is native"). A kernel is
    rebuilt in about a millisecond, and within one step the shapes that repeat (30 layers of one shape) stay cached.
    Read when the first oneDNN kernel is built, so this must run before the first bf16 matmul; exported values win.
    """
    for var in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):  # oneDNN's, ideep's (0 crashes it)
        os.environ.setdefault(var, str(ONEDNN_CACHE_CAPACITY))


def memory_gb() -> dict[str, float]:
    """This process's resident memory now and its high-water mark so far, in GB (Linux; {} elsewhere): logged
    every step, so a run shows where its peak came and how far above the 16 bytes/param floor it sits."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return {}
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KB on Linux
    return {"mem/rss_gb": pages * os.sysconf("SC_PAGE_SIZE") / 1e9, "mem/peak_rss_gb": peak_kb * 1024 / 1e9}


class _MallInfo2(ctypes.Structure):
    """glibc's struct mallinfo2 (glibc >= 2.33): the heap's counters in size_t."""

    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_gb() -> dict[str, float]:
    """glibc's own account of its heap, in GB: bytes in use, free inside the heap, and blocks mapped on their
    own ({} off glibc or before 2.33). A heap in use that climbs while live tensors stay flat is memory held
    outside tensors: how the bf16 kernel caches were found (`bound_onednn_caches`, bench/memory.py step_memory)."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return {}
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return {"heap_in_use_gb": info.uordblks / 1e9, "heap_free_gb": info.fordblks / 1e9, "mapped_gb": info.hblkhd / 1e9}


def trim_memory() -> None:
    """Give free heap pages back to the OS (malloc_trim) between the phases of a step; a no-op off glibc."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def cache_dir() -> Path:
    """Where prepared and tiny models live: $RELAYRL_CACHE, else ~/.cache/relayrl."""
    return Path(os.environ.get("RELAYRL_CACHE") or Path.home() / ".cache" / "relayrl").expanduser()


def close_all(closers) -> None:
    """Call every closer in order (None entries skipped) even if one fails, then raise the first failure: one
    part that fails to close must not leak the processes and threads of the others."""
    errors = []
    for close in filter(None, closers):
        try:
            close()
        except Exception as e:  # noqa: PERF203 - keep closing the rest
            errors.append(e)
    if errors:
        raise errors[0]
