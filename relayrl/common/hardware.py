"""What the hardware does natively, and the precisions chosen from it: `engine.dtype: auto` (bf16 wherever it is
native, float32 elsewhere, `resolve_dtype`) and `model.autocast_bf16: auto` (the trainer's matmuls in bf16
wherever bf16 is native, CPUs included, `resolve_autocast`).

Why measure: bf16 is 2-4x faster than fp32 where the CPU has AVX512-BF16 or AMX, and about 65x *slower* where
it has only AVX2 (PyTorch then emulates it). torch's capability string does not tell the two apart ("AVX512"
on both kinds of AVX-512 machine) and environment switches (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA) change
what the same CPU does. So: no bf16 flag in /proc/cpuinfo means no native bf16; otherwise a 256x256 matmul
in both dtypes decides (a few milliseconds), cached per machine, torch version and those switches in
~/.cache/relayrl/hardware.json. On CUDA, the device's own answer (torch.cuda.is_bf16_supported) is used.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from relayrl.common.utils import atomic_write_text, cache_dir

logger = logging.getLogger(__name__)

_ENV_SWITCHES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


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
        return Bf16Support(False, f"{model}: no avx512_bf16/amx_bf16 (bf16 would be emulated, ~65x slower)")
    key = _cache_key(model, flags)
    cached = _read_cache().get(key)
    if cached is None:
        cached = _measure()
        _write_cache(key, cached)
    native = cached["bf16_gflops"] >= cached["fp32_gflops"]
    return Bf16Support(native, f"{model}: bf16 matmul {cached['bf16_gflops']:.0f} GFLOP/s vs fp32 "
                               f"{cached['fp32_gflops']:.0f} (measured, cached)")


def measured(name: str, measure: Callable[[], dict]) -> dict:
    """`measure()`'s result for this machine (CPU model and flags, torch version, ISA switches), measured once and
    cached beside bf16_support's in ~/.cache/relayrl/hardware.json: for choices no flag can make (which kernel
    library is faster here)."""
    model, flags = _cpuinfo()
    key = f"{_cache_key(model, flags)}:{name}"
    cached = _read_cache().get(key)
    if cached is None:
        cached = measure() | {"measured_at": time.time()}
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
# device's memory: then a step would not fit with its activations, runtime and engine (1.2-1.5x the floor measured
# with the memory settings, docs/benchmarks.md "Scaling with model size"), and bf16 weights (8 B/param) let it run
BF16_WEIGHTS_SHARE = 0.5


def resolve_train_dtype(setting: str, device: str, params: int | None, memory: int | None) -> tuple[str, str]:
    """model.train_dtype -> (dtype name, reason). "auto": float32, unless the fp32 floor of `params` trainable
    parameters is at least BF16_WEIGHTS_SHARE of the device's `memory` and bf16 is native there (on an AVX2 CPU bf16
    weights would run ~65x slower). None for either count: unknown, float32."""
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
    AMX): there the README job's fits take ~0.7x the time at about the same peak memory (docs/benchmarks.md,
    "bf16 autocast by default where it is native"); where bf16 is emulated (AVX2) it would be ~65x slower."""
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


def _gflops(dtype: torch.dtype, n: int = 256, seconds: float = 0.03) -> float:
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n**3 / seconds_per_call(lambda: a @ b, seconds) / 1e9


def _measure() -> dict[str, float]:
    return {"fp32_gflops": _gflops(torch.float32), "bf16_gflops": _gflops(torch.bfloat16), "measured_at": time.time()}


def _cache_key(model: str, flags: frozenset[str]) -> str:
    parts = [model, " ".join(sorted(flags)), torch.__version__, *(os.environ.get(k, "") for k in _ENV_SWITCHES)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _cache_path() -> Path:
    return cache_dir() / "hardware.json"


def _read_cache() -> dict:
    try:
        return json.loads(_cache_path().read_text())
    except (OSError, ValueError):
        return {}


def _write_cache(key: str, entry: dict) -> None:
    try:
        atomic_write_text(_cache_path(), json.dumps(_read_cache() | {key: entry}, indent=1) + "\n")
    except OSError as e:  # a read-only home costs a re-measurement next time, nothing else
        logger.debug("hardware cache not written: %s", e)
