"""Compile one of relayrl's small C kernels for this machine, once, and cache the shared library.

Six components have a C kernel (the engine's decode attention, few-row linears and decode-step norm/rotary ops, the
trainer's bf16-moment AdamW, shared-prompt attention and one-pass RMSNorm/SwiGLU); each is built with the system C
compiler, the flags in `CFLAGS` and `-march=native` into `cache_dir()/kernels`, keyed by the source, the command line,
the CPU's feature flags and the architecture, so a cache folder shared between machines never hands a library to a
CPU without its instructions. Where torch is restricted to a lower ISA (ATEN_CPU_CAPABILITY=avx2 or default, e.g.
`--cpu avx2` in the benches), the kernels are built for that ISA too (x86-64-v3 or baseline x86-64), so a
measurement "as on an AVX2 CPU" is that for the kernels as well; RELAYRL_KERNELS_MARCH names a target outright
(x86-64-v3, x86-64-v4, native: what tests/unit/test_kernel_targets.py builds each kernel for). The library is
written to a temp file and renamed, so concurrent processes never load a half-written one. Callers load it with
ctypes (which releases the GIL during calls) and fall back to PyTorch when the build fails or the kernel is
switched off (`kernels_enabled`).

Why no -ffast-math: it lets the compiler replace a division by a reciprocal estimate and 1/sqrt by rsqrt, each
refined by one Newton step whose result depends on the ISA (rcp14 on AVX-512, rcp on AVX2). The same source then
computed different numbers on different CPUs: sigmoid(g) = 1 / (1 + exp(-g)) came out as 1 - 6e-8 for large g with
AVX-512's estimate (exactly 1 elsewhere), and SwiGLU's gradient g * (1 - s) was off by 6e-4 relative. `CFLAGS` keeps
what is CPU-independent: no errno (so expf vectorises through glibc's libmvec, declared `simd` in each source that calls
it), no NaN or inf operands assumed (the kernels keep their arguments finite), and reassociation, which only reorders
sums and reductions: results then differ by vector width at rounding level, which the tests' tolerances bound.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
from pathlib import Path

from relayrl.common.files import cache_dir

log = logging.getLogger(__name__)


def kernels_enabled(name: str | None = None) -> bool:
    """RELAYRL_KERNELS=0 switches every C kernel off (PyTorch paths only); RELAYRL_KERNELS_OFF=name,... switches off
    the named ones (the stem of their source: adamw_bf16, decode_attention, decode_ops, norm_swiglu,
    segment_attention, skinny_linear), e.g. to compare one kernel with its PyTorch fallback in one run."""
    off = {n.strip() for n in os.environ.get("RELAYRL_KERNELS_OFF", "").split(",")}
    return os.environ.get("RELAYRL_KERNELS", "1") != "0" and name not in off


@functools.cache
def _cpu_flags() -> str:
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return ""


CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros",
          "-fassociative-math", "-ffinite-math-only"]
MARCH_ENV = "RELAYRL_KERNELS_MARCH"
TARGETS = ("x86-64-v3", "x86-64-v4", "native")  # what RELAYRL_KERNELS_MARCH takes
_MARCH_FOR_CAPABILITY = {"avx2": "x86-64-v3", "default": "x86-64"}
# the CPU flags a -march level needs (gcc's x86-64-v3/-v4 definitions, as /proc/cpuinfo spells them)
_V3 = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave", "abm"}
_NEEDS = {"x86-64-v3": _V3, "x86-64-v4": _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
          "native": set()}


def _x86() -> bool:
    return platform.machine() in ("x86_64", "AMD64")


# glibc's vector math library on x86: the vectorised expf the sources declare `simd` (there only)
LIBS = ["-lmvec", "-lm"] if _x86() else ["-lm"]


def runnable_targets() -> list[str]:
    """The RELAYRL_KERNELS_MARCH targets whose instructions this CPU has (x86; elsewhere only native)."""
    if not _x86():
        return ["native"]
    have = set(_cpu_flags().split())
    return [t for t in TARGETS if _NEEDS[t] <= have]


def _target_flags(cflags: list[str]) -> list[str]:
    """cflags with -march=native replaced by RELAYRL_KERNELS_MARCH's target, or lowered to the ISA torch is
    restricted to (ATEN_CPU_CAPABILITY; x86 only)."""
    march = os.environ.get(MARCH_ENV, "")
    if march and march not in TARGETS:
        raise OSError(f"{MARCH_ENV}={march!r}: expected one of {', '.join(TARGETS)}")
    cap = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    if not march and _x86() and cap in _MARCH_FOR_CAPABILITY:
        march = _MARCH_FOR_CAPABILITY[cap]
    if not march or not _x86():
        return list(cflags)
    return [f"-march={march}" if f == "-march=native" else f for f in cflags]


def build_library(source: Path, cflags: list[str] = CFLAGS, libs: list[str] = LIBS) -> Path:
    """The path of `source` compiled into a shared library for this machine; raises OSError if the build fails."""
    cc, cflags = os.environ.get("CC", "cc"), _target_flags(cflags)
    key = hashlib.sha256(b"\0".join([source.read_bytes(), " ".join([cc, *cflags, *libs]).encode(),
                                     _cpu_flags().encode(), platform.machine().encode()])).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"{source.stem}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.stem}.{os.getpid()}.so")
        try:
            proc = subprocess.run([cc, *cflags, "-shared", "-fPIC", str(source), "-o", str(tmp), *libs],
                                  capture_output=True, text=True, timeout=300)
        except subprocess.SubprocessError as e:
            raise OSError(f"{cc} on {source.name}: {e}") from e
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise OSError(f"{cc} failed on {source.name}: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    return target


def load(source: Path, *, signatures: dict[str, tuple[list, object]], fallback: str,
         cflags: list[str] = CFLAGS, libs: list[str] = LIBS) -> ctypes.CDLL | None:
    """`source` built (build_library) and loaded, each function in `signatures` ({name: (argtypes, restype)})
    declared; None when the kernel is switched off (kernels_enabled by the source's stem) or cannot be built, which
    is logged with `fallback`, the path the caller takes instead. Callers cache the result (functools.cache).
    `cflags` other than CFLAGS are for benches comparing builds (bench/kernels.py kernel_math)."""
    if not kernels_enabled(source.stem):
        return None
    try:
        lib = ctypes.CDLL(str(build_library(source, cflags, libs)))
    except OSError as e:
        log.warning("%s kernel unavailable, %s: %s", source.stem, fallback, e)
        return None
    for name, (argtypes, restype) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib
