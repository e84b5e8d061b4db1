"""Every C kernel, built for every x86 target this CPU can run, computes what its reference computes.

Why: a kernel is built with -march=native, so the instructions it runs differ by CPU. Before, -ffast-math let the
compiler use ISA-dependent reciprocal estimates, and a kernel written and tested on a Zen 4 computed SwiGLU's
gradient 6e-4 off on a Sapphire Rapids Xeon. Here each kernel is built for x86-64-v3 (AVX2), x86-64-v4 (AVX-512,
where the CPU has it) through RELAYRL_KERNELS_MARCH, and the kernels' own reference tests (against PyTorch, the
formula, or the model's plain forward) run in a subprocess against those builds; `native`, the build every run
uses, is what the rest of the suite tests. The tolerances, and why they hold on every target, are written next to
each reference test. A target this CPU lacks is skipped with the reason, so an AVX2 machine says it did not
check AVX-512.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bounds import bound

from relayrl.common import cbuild
from relayrl.common.files import cache_dir
from relayrl.engine import attention, direct, skinny
from relayrl.models import fused, segments
from relayrl.trainer import optim

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler here")

TESTS = Path(__file__).resolve().parents[1]
SOURCES = [attention._SOURCE, direct._SOURCE, skinny._SOURCE, fused._SOURCE, segments._SOURCE, optim._SOURCE]
# the reference tests of the six kernels (every test in these files compares a kernel with its reference)
REFERENCE_TESTS = ["unit/test_attention_kernel.py", "unit/test_decode_ops.py", "unit/test_engine_skinny.py",
                   "unit/test_fused_layers.py", "unit/test_segment_attention.py", "unit/test_optim.py"]
# a bound that only a hang reaches: the files take ~35 s on 2 idle cores (tests/bounds.py scales it to the load)
HANG_S = 300


def _objdump(path: Path) -> str:
    return subprocess.run(["objdump", "-d", str(path)], capture_output=True, text=True).stdout


@pytest.mark.parametrize("target", ["x86-64-v3", "x86-64-v4"])
def test_each_kernel_built_for_the_target_matches_its_reference(target, monkeypatch):
    if target not in cbuild.runnable_targets():
        pytest.skip(f"this CPU cannot run {target} code (flags it needs: {sorted(cbuild._NEEDS[target])})")
    # a cache of the target's own, kept between runs: its kernels compile (and its tiny models build) once per
    # machine and source, not in every run of the suite
    cache = cache_dir() / "kernel-targets" / target
    env = {**os.environ, cbuild.MARCH_ENV: target, "RELAYRL_KERNELS": "1", "RELAYRL_KERNELS_OFF": "",
           "RELAYRL_CACHE": str(cache), "OMP_NUM_THREADS": "2", "PYTHONPATH": str(TESTS)}
    for key in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_TESTRUNUID", "PYTEST_CURRENT_TEST"):
        env.pop(key, None)
    monkeypatch.setenv(cbuild.MARCH_ENV, target)
    monkeypatch.setenv("RELAYRL_CACHE", str(cache))
    libs = [cbuild.build_library(src) for src in SOURCES]  # each builds for the target (raises if not)
    started = time.time()
    assert len({lib.name for lib in libs}) == len(SOURCES)
    if shutil.which("objdump"):
        wide = ["zmm" in _objdump(lib) for lib in libs]
        assert not any(wide) if target == "x86-64-v3" else any(wide), wide  # the build is that target's
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                           "-rs", *(str(TESTS / t) for t in REFERENCE_TESTS)],
                          cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=bound(HANG_S))
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-2000:]
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "skipped" not in summary, proc.stdout[-3000:]  # a kernel that did not build would skip its tests
    # the subprocess used the libraries built above: nothing else was built into its cache while it ran
    built = {p.name for p in (cache / "kernels").glob("*.so") if p.stat().st_mtime >= started}
    assert built <= {lib.name for lib in libs}, built


def test_the_march_override_is_checked_and_replaces_native(monkeypatch):
    monkeypatch.setenv(cbuild.MARCH_ENV, "x86-64-v4")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")  # the explicit target wins over torch's restriction
    flags = cbuild._target_flags(cbuild.CFLAGS)
    if cbuild._x86():
        assert "-march=x86-64-v4" in flags and "-march=native" not in flags
    monkeypatch.setenv(cbuild.MARCH_ENV, "skylake")
    with pytest.raises(OSError, match="RELAYRL_KERNELS_MARCH='skylake'"):
        cbuild._target_flags(cbuild.CFLAGS)


def test_no_kernel_is_built_with_approximations_that_differ_by_cpu():
    """-ffast-math (or -funsafe-math-optimizations / -freciprocal-math) let gcc use rcp/rsqrt estimates, whose
    error differs between AVX2 and AVX-512; none of the six kernels may be built with them."""
    unsafe = {"-ffast-math", "-funsafe-math-optimizations", "-freciprocal-math", "-Ofast"}
    assert not unsafe & set(cbuild.CFLAGS)
    if shutil.which("objdump") and cbuild._x86():
        for src in SOURCES:
            code = _objdump(cbuild.build_library(src))
            assert not any(op in code for op in ("rcpps", "rcpss", "rcp14", "rsqrtps", "rsqrtss", "rsqrt14")), src.name
