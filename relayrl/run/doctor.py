"""`relayrl doctor`: what this machine is, what relayrl measured on it, and what it chooses from that.

Why: the precision and kernel choices are made from a measurement cached per machine (relayrl.common.hardware) and
from the CPU's flags, and a wrong one (a probe taken under load, a kernel that did not build) shows only as a slow
or a different run. This prints every input of those choices and the choice, so a bug report can carry it:
the CPU and its flags, the ISA switches, the matmul rates (cached or measured now) with the load and thread count
they were taken at, the precisions `auto` resolves to, which target the C kernels build for and whether each
builds, and the other per-machine measurements in the cache. `--remeasure` drops this machine's cached entries
first.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Iterator

import torch

from relayrl.common import cbuild, hardware
from relayrl.common.files import cache_dir

_FLAGS_SHOWN = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")
_KERNELS = {"decode_attention": "relayrl.engine.attention", "decode_ops": "relayrl.engine.direct",
            "skinny_linear": "relayrl.engine.skinny", "norm_swiglu": "relayrl.models.fused",
            "segment_attention": "relayrl.models.segments", "adamw_bf16": "relayrl.trainer.optim"}


def report(remeasure: bool = False) -> Iterator[str]:
    """The doctor's lines, in the order a reader needs them."""
    model, flags = hardware._cpuinfo()
    key = hardware._cache_key(model, flags)
    if remeasure:
        hardware.forget(key)
    yield f"cpu: {model}, {torch.get_num_threads()} torch threads; torch capability " \
          f"{torch.backends.cpu.get_cpu_capability()}"
    yield "cpu flags: " + (" ".join(f for f in _FLAGS_SHOWN if f in flags) or "none of " + " ".join(_FLAGS_SHOWN))
    yield f"isa switches: {hardware._switched() or 'none'}"
    yield from _probe_lines(flags)
    yield from _choice_lines()
    yield from _kernel_lines()
    yield from _cached_lines(key)


def _probe_lines(flags: frozenset[str]) -> Iterator[str]:
    if flags and not any(f in flags for f in hardware._BF16_FLAGS):
        yield "matmul probe: not run (no bf16 flag: bf16 is emulated here)"
        return
    entry, why = hardware.probe(flags)
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(entry["measured_at"]))
    yield (f"matmul 256x256: fp32 {entry['fp32_gflops']:.1f} GFLOP/s, bf16 {entry['bf16_gflops']:.1f} GFLOP/s "
           f"({entry['source']}: {when}, {entry.get('threads', '?')} threads, load {entry.get('load', '?')})")
    isa = torch.backends.cpu.get_cpu_capability()
    floor = hardware.FP32_FLOOR_PER_THREAD.get(isa, 0.0) * entry.get("threads", 1)
    yield f"plausible: {'yes' if why is None else 'no, ' + why} (fp32 floor for {isa}: {floor:.0f} GFLOP/s)"


def _choice_lines() -> Iterator[str]:
    support = hardware.bf16_support("cpu")
    yield f"bf16 native: {'yes' if support.native else 'no'} ({support.reason})"
    engine, why = hardware.resolve_dtype("auto")
    yield f"engine.dtype auto -> {engine} ({why})"
    yield f"model.autocast_bf16 auto -> {hardware.resolve_autocast('auto', engine)}"
    yield (f"model.train_dtype auto -> float32 unless a model's fp32 floor (16 B/param) is "
           f">= {hardware.BF16_WEIGHTS_SHARE:.0%} of memory and bf16 is native")


def _kernel_lines() -> Iterator[str]:
    march = next((f for f in cbuild._target_flags(cbuild.CFLAGS) if f.startswith("-march")), "-march=native")
    yield f"c kernels: built {march} {' '.join(f for f in cbuild.CFLAGS if not f.startswith('-march'))}"
    for name, module in _KERNELS.items():
        if not cbuild.kernels_enabled(name):
            yield f"  {name}: switched off (RELAYRL_KERNELS / RELAYRL_KERNELS_OFF)"
            continue
        source = importlib.import_module(module)._SOURCE
        try:
            yield f"  {name}: ok ({cbuild.build_library(source).name})"
        except OSError as e:
            yield f"  {name}: did not build, PyTorch runs instead: {str(e)[:200]}"


def _cached_lines(key: str) -> Iterator[str]:
    mine = {k.partition(":")[2]: v for k, v in hardware._read_cache().items() if k.startswith(key + ":")}
    yield f"cache: {cache_dir() / 'hardware.json'}" + ("" if mine else " (no other measurements for this machine)")
    for name, entry in sorted(mine.items()):
        shown = {k: v for k, v in entry.items() if k != "measured_at" and isinstance(v, int | float | str)}
        yield f"  {name}: {shown}"
