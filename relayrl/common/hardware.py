"""What the hardware does natively, and the precisions chosen from it: `engine.dtype: auto` (bf16 wherever it is
native, float32 elsewhere, `resolve_dtype`) and `model.autocast_bf16: auto` (the trainer's matmuls in bf16
wherever bf16 is native, CPUs included, `resolve_autocast`).

Why measure: bf16 is several times faster than fp32 where the CPU has AVX512-BF16 or AMX, and far *slower*
where it has only AVX2 (PyTorch then emulates it), so a wrong guess either way costs a large factor. torch's capability
string does not tell the two apart ("AVX512" on both kinds of AVX-512 machine) and environment switches
(ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA) change what the same CPU does. So: no bf16 flag in /proc/cpuinfo means no
native bf16; otherwise a 256x256 matmul in both dtypes decides (`_measure`: a warm-up, then the two dtypes interleaved,
the fastest of several repeats each, so that a busy machine slows both alike). On CUDA, the device's own answer
(torch.cuda.is_bf16_supported) is used.

Why the plausibility check: the answer is cached per machine in ~/.cache/relayrl/hardware.json and every later
run reads it, so one measurement taken while other processes held the cores would pick the wrong precision for
good (under load, OpenMP threads waiting on each other can make a fast CPU's fp32 look a small fraction of what it
is; docs/benchmarks.md, "The hardware probe"). A measurement is cached only when it agrees with the CPU's flags
(`implausible`): fp32 at least `FP32_FLOOR_PER_THREAD` for torch's ISA, and bf16 no slower than fp32 where the CPU has
AVX512-BF16 or AMX and no ISA switch is set. Otherwise it is taken again (`PROBE_ATTEMPTS` in all); if it still
disagrees, this run goes by the flags and nothing is cached. Cached entries are checked the same way when read, and
keyed by relayrl's and torch's versions, so an upgrade measures anew. `relayrl doctor` prints what was measured and
chosen.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from relayrl.common.files import atomic_write_text, cache_dir

logger = logging.getLogger(__name__)

_ENV_SWITCHES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
PROBE_ATTEMPTS = 3  # measurements before one that disagrees with the CPU flags is used for this run only
# The least fp32 GFLOP/s of a 256x256 matmul per torch thread for torch's ISA: a third to a quarter of what the
# slowest such cores do (one FMA unit at ~1.5 GHz), a sixth to an eighth of current ones, so only a disturbed
# measurement falls below.
FP32_FLOOR_PER_THREAD = {"AVX512": 20.0, "AVX2": 10.0}
# A measurement taken while the 1-minute load was at least this share of the cores is cached for BUSY_TTL_S only:
# it may be what other processes left of the machine, so it must not decide for good.
BUSY_LOAD_SHARE, BUSY_TTL_S = 0.5, 3600.0
_PROBE_FORMAT = 2  # bumped when the measurement changes meaning: older cache entries are then not read
# key -> a probe result that disagreed with the flags: never written to the cache, but kept for this process so
# that a second question (`relayrl doctor` asks for the rates, then for the choice) does not measure again
_uncached: dict[str, tuple[dict, str | None]] = {}


@dataclass(frozen=True)
class Bf16Support:
    native: bool
    reason: str  # one line for the start-up log: what was measured or read


def cpu_info() -> dict[str, str]:
    """CPU model, torch's capability, the bf16 flags and the env switches in force: recorded with every benchmark."""
    model, flags = _cpuinfo()
    info = {"cpu_model": model, "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "bf16_flags": ",".join(f for f in _BF16_FLAGS if f in flags) or "none",
            "torch": torch.__version__, "cores": str(os.cpu_count())}
    info.update({k.lower(): os.environ[k] for k in _ENV_SWITCHES if k in os.environ})
    return info


@functools.cache
def _cpuinfo() -> tuple[str, frozenset[str]]:
    model, flags = platform.processor() or "unknown", frozenset()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return model, flags
    fields: dict[str, str] = {}
    for line in text.splitlines():  # the first CPU's entries (every core lists the same)
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    if "model name" in fields:
        model = fields["model name"]
    if "flags" in fields:
        flags = frozenset(fields["flags"].split())
    return model, flags


@functools.cache
def bf16_support(device: str = "cpu") -> Bf16Support:
    """Whether bf16 matmuls run natively (at least as fast as fp32) on `device` ("cpu" or "cuda")."""
    if device.startswith("cuda"):
        ok = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return Bf16Support(ok, f"CUDA device {'supports' if ok else 'lacks'} bf16")
    model, flags = _cpuinfo()
    if flags and not any(f in flags for f in _BF16_FLAGS):
        return Bf16Support(False, f"{model}: no avx512_bf16/amx_bf16 (bf16 would be emulated, far slower)")
    entry, why = probe(flags)
    rates = f"bf16 matmul {entry['bf16_gflops']:.0f} GFLOP/s vs fp32 {entry['fp32_gflops']:.0f}"
    if why is None:
        native = entry["bf16_gflops"] >= entry["fp32_gflops"]
        return Bf16Support(native, f"{model}: {rates} ({entry.get('source', 'measured')})")
    native = _switched() is None and any(f in flags for f in _BF16_FLAGS)
    return Bf16Support(native, f"{model}: {rates}, {why} after {PROBE_ATTEMPTS} tries: not cached, "
                               f"{'going by the CPU flags' if native else 'bf16 not native'}")


def probe(flags: frozenset[str]) -> tuple[dict, str | None]:
    """This machine's matmul rates (cached, or measured up to PROBE_ATTEMPTS times and cached when plausible) and
    why they are implausible (None: they agree with the flags). The entry's "source" says which."""
    key = _cache_key(*_cpuinfo())
    cached = _read_cache().get(key)
    if cached is not None and implausible(cached, flags) is None:
        return cached | {"source": "measured, cached"}, None
    if key in _uncached:  # measured already in this process and never cached: the same answer, not 3 more tries
        return _uncached[key]
    best: dict = {}
    for _ in range(PROBE_ATTEMPTS):
        m = _measure() | _stamp(os.getloadavg()[0])
        best = m if not best else m | {k: max(best[k], m[k]) for k in ("fp32_gflops", "bf16_gflops")}
        why = implausible(best, flags)
        if why is None:
            _write_cache(key, best)
            return best | {"source": "measured now, cached"}, None
        logger.info("hardware probe: %s; measuring again", why)
    _uncached[key] = best | {"source": "measured now, not cached"}, why
    return _uncached[key]


def implausible(entry: dict, flags: frozenset[str]) -> str | None:
    """Why a measurement disagrees with what the CPU's flags promise (None: it agrees): fp32 below the floor of
    torch's ISA, or bf16 slower than fp32 on a CPU with AVX512-BF16/AMX when no ISA switch is set."""
    isa, threads = torch.backends.cpu.get_cpu_capability(), entry.get("threads", 1)
    floor = FP32_FLOOR_PER_THREAD.get(isa, 0.0) * threads
    if entry["fp32_gflops"] < floor:
        return f"fp32 {entry['fp32_gflops']:.1f} GFLOP/s is below {floor:.0f}, the least of {isa} on {threads} threads"
    bf16 = [f for f in _BF16_FLAGS if f in flags]
    if bf16 and _switched() is None and entry["bf16_gflops"] < entry["fp32_gflops"]:
        return f"bf16 measured slower than fp32 on a CPU with {'/'.join(bf16)}"
    return None


def _switched() -> str | None:
    """The ISA switches in force (they may legitimately make bf16 emulated on a bf16 CPU), or None."""
    on = [f"{k}={os.environ[k]}" for k in _ENV_SWITCHES if os.environ.get(k)]
    return " ".join(on) or None


def measured(name: str, measure: Callable[[], dict]) -> dict:
    """`measure()`'s result for this machine (CPU model and flags, torch version, ISA switches), measured once and
    cached beside bf16_support's in ~/.cache/relayrl/hardware.json: for choices no flag can make (which kernel
    library is faster here)."""
    model, flags = _cpuinfo()
    key = f"{_cache_key(model, flags)}:{name}"
    cached = _read_cache().get(key)
    if cached is None:
        load = os.getloadavg()[0]
        cached = measure() | _stamp(load)
        _write_cache(key, cached)
    return cached


def resolve_dtype(setting: str, device: str = "cpu", autocast: bool | str = "auto",
                  train_dtype: str = "float32") -> tuple[str, str]:
    """An engine dtype setting -> (dtype name, reason). "auto": bfloat16 wherever bf16 is native (a GPU that has
    it, a CPU with AVX512-BF16 or AMX), float32 elsewhere. On a CPU with an fp32 trainer (`autocast` False, the
    trainer's model.autocast_bf16 as set) it stays float32: one model shared by engine and trainer, nothing to
    sync. A bf16 engine beside the trainer's fp32 master weights gets them rounded stochastically
    (relayrl.trainer.optim.round_to_bf16_); rounded to nearest it kept sampling from the first policy for many
    steps and learned far less (docs/benchmarks.md, "A bf16 engine that learns")."""
    if setting != "auto":
        return setting, "set in the config"
    support = bf16_support(device)
    if device.startswith("cuda"):
        return ("bfloat16" if support.native else "float32"), support.reason
    one = "one model for engine and trainer" if train_dtype == "float32" else "beside bf16 trainer weights"
    if not support.native:
        return "float32", f"CPU: float32, {one} (bf16 not native here: {support.reason})"
    if autocast is False:
        return "float32", f"CPU: float32, {one} (an fp32 trainer; {support.reason})"
    return "bfloat16", f"CPU with native bf16: bf16 engine, bf16 matmuls in the trainer ({support.reason})"


# model.train_dtype "auto" keeps fp32 weights unless their training floor (16 B/param) is at least this share of the
# device's memory: then a step would not fit with its activations, runtime and engine (which add a fraction of
# the floor again even with the memory settings, docs/benchmarks.md "Scaling with model size"), and bf16 weights
# (8 B/param) let it run
BF16_WEIGHTS_SHARE = 0.5


def resolve_train_dtype(setting: str, device: str, params: int | None, memory: int | None) -> tuple[str, str]:
    """model.train_dtype -> (dtype name, reason). "auto": float32, unless the fp32 floor of `params` trainable
    parameters is at least BF16_WEIGHTS_SHARE of the device's `memory` and bf16 is native there (on an AVX2 CPU bf16
    is emulated and bf16 weights would run many times slower). None for either count: unknown, float32."""
    if setting != "auto":
        slow = setting == "bfloat16" and not bf16_support(device).native
        return setting, "set in the config" + ("; bf16 is not native here: its matmuls run far slower" if slow else "")
    if not params or not memory or 16 * params < BF16_WEIGHTS_SHARE * memory:
        return "float32", "auto: fp32 weights fit"
    share = f"the fp32 floor {16 * params / 1e9:.1f} GB is {16 * params / memory:.0%} of {memory / 1e9:.1f} GB"
    if not bf16_support(device).native:
        return "float32", f"auto: {share}, but bf16 is not native here"
    return "bfloat16", f"auto: {share}; bf16 weights need half"


def resolve_autocast(setting: bool | str, engine_dtype: str, device: str = "cpu") -> bool:
    """model.autocast_bf16 -> whether the trainer's matmuls run in bf16 (fp32 weights, gradients and AdamW).
    "auto": yes where the engine runs bf16 (a GPU that has it), and on a CPU where bf16 is native (AVX512-BF16,
    AMX): there the matmuls, most of a fit's time, run faster at about the same peak memory (docs/benchmarks.md,
    "bf16 autocast by default where it is native"); where bf16 is emulated (AVX2) it would be many times slower."""
    if setting != "auto":
        return bool(setting)
    return engine_dtype == "bfloat16" or (device == "cpu" and bf16_support("cpu").native)


def seconds_per_call(fn: Callable[[], object], budget: float, min_reps: int = 2) -> float:
    """Mean seconds of fn() over at least `budget` seconds and `min_reps` calls, after one untimed call (kernel
    selection, page faults): the quick measurements behind relayrl's per-machine choices."""
    fn()
    reps, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < budget or reps < min_reps:
        fn()
        reps += 1
    return elapsed / reps


def _measure(n: int = 256, repeats: int = 7, seconds: float = 0.002) -> dict[str, float]:
    """GFLOP/s of an n x n matmul in fp32 and bf16 on one thread: one warm-up call each (kernel selection, page
    faults), then `repeats` rounds alternating the dtypes, each round timing calls for >= `seconds`; the fastest
    round counts, so a round slowed by another process does not. One thread, because the question is what a core's
    instructions do, and two OpenMP threads on a busy machine wait on each other, which can make the
    same matmul many times slower on two threads than on one (docs/benchmarks.md, "The hardware probe")."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        mats = {dt: (torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)) for dt in (torch.float32, torch.bfloat16)}
        best = dict.fromkeys(mats, float("inf"))
        for a, b in mats.values():
            a @ b
        for _ in range(repeats):
            for dt, (a, b) in mats.items():
                calls, t0 = 0, time.perf_counter()
                while (elapsed := time.perf_counter() - t0) < seconds or calls == 0:
                    a @ b
                    calls += 1
                best[dt] = min(best[dt], elapsed / calls)
    finally:
        torch.set_num_threads(threads)
    flop = 2 * n**3 / 1e9
    return {"fp32_gflops": flop / best[torch.float32], "bf16_gflops": flop / best[torch.bfloat16], "threads": 1}


def _stamp(load: float) -> dict:
    """When a measurement was taken and at what 1-minute load (taken before it ran); one taken on a busy machine
    expires after BUSY_TTL_S."""
    now = time.time()
    busy = load >= BUSY_LOAD_SHARE * (os.cpu_count() or 1)
    return {"load": round(load, 2), "measured_at": now, **({"expires_at": now + BUSY_TTL_S} if busy else {})}


def _cache_key(model: str, flags: frozenset[str]) -> str:
    """This machine as the cache sees it: CPU, flags, the ISA switches, torch's thread count and the versions of
    torch, relayrl and the probe (an upgrade measures anew)."""
    parts = [model, " ".join(sorted(flags)), torch.__version__, _relayrl_version(), str(_PROBE_FORMAT),
             str(torch.get_num_threads()), *(os.environ.get(k, "") for k in _ENV_SWITCHES)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _cache_path() -> Path:
    return cache_dir() / "hardware.json"


def _read_cache() -> dict:
    """The cached measurements that have not expired."""
    try:
        entries = json.loads(_cache_path().read_text())
    except (OSError, ValueError):
        return {}
    now = time.time()
    return {k: v for k, v in entries.items() if isinstance(v, dict) and v.get("expires_at", now + 1) > now}


def _relayrl_version() -> str:
    """relayrl's version from the installed package's metadata (a new release measures again); read there because
    a module this low must not import the package top. A checkout that was never installed reads as "source"."""
    try:
        return importlib.metadata.version("relayrl")
    except importlib.metadata.PackageNotFoundError:
        return "source"


def forget(key: str) -> None:
    """Drop this machine's cached measurements (`key` and its named ones): the next read measures anew."""
    kept = {k: v for k, v in _read_cache().items() if k != key and not k.startswith(key + ":")}
    try:
        atomic_write_text(_cache_path(), json.dumps(kept, indent=1) + "\n")
    except OSError as e:
        logger.debug("hardware cache not written: %s", e)
    bf16_support.cache_clear()
    _uncached.pop(key, None)


def _write_cache(key: str, entry: dict) -> None:
    try:
        atomic_write_text(_cache_path(), json.dumps(_read_cache() | {key: entry}, indent=1) + "\n")
    except OSError as e:  # a read-only home costs a re-measurement next time, nothing else
        logger.debug("hardware cache not written: %s", e)
