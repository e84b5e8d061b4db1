"""relayrl.common.cbuild: one library per machine and ISA, built for the ISA torch is restricted to."""

import ctypes
import platform
import shutil
import subprocess

import pytest

from relayrl.common import cbuild
from relayrl.trainer import optim

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler here")
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp"]


def test_a_library_is_built_once_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("RELAYRL_CACHE", str(tmp_path))
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    first = cbuild.build_library(optim._SOURCE, FLAGS)
    stamp = first.stat().st_mtime_ns
    assert cbuild.build_library(optim._SOURCE, FLAGS) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temp file left behind
    ctypes.CDLL(str(first)).relayrl_adamw_bf16  # noqa: B018 - the symbol is there


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the ISA switch is for x86 CPUs")
def test_kernels_follow_torchs_isa_restriction(tmp_path, monkeypatch):
    monkeypatch.setenv("RELAYRL_CACHE", str(tmp_path))
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    assert cbuild._target_flags(FLAGS) == FLAGS
    native = cbuild.build_library(optim._SOURCE, FLAGS)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert "-march=x86-64-v3" in cbuild._target_flags(FLAGS) and "-march=native" not in cbuild._target_flags(FLAGS)
    avx2 = cbuild.build_library(optim._SOURCE, FLAGS)
    assert avx2 != native and avx2.exists()
    ctypes.CDLL(str(avx2)).relayrl_adamw_bf16  # noqa: B018
    if shutil.which("objdump"):  # an AVX2 build never touches the 512-bit registers
        assert "zmm" not in subprocess.run(["objdump", "-d", str(avx2)], capture_output=True, text=True).stdout


def test_kernels_switch_off_all_or_by_name(monkeypatch):
    from relayrl.models import segments

    monkeypatch.delenv("RELAYRL_KERNELS", raising=False)
    monkeypatch.setenv("RELAYRL_KERNELS_OFF", "segment_attention, decode_attention")
    assert not cbuild.kernels_enabled("segment_attention") and not cbuild.kernels_enabled("decode_attention")
    assert cbuild.kernels_enabled("adamw_bf16")
    assert segments.load_kernel.__wrapped__() is None  # the trainer then runs the PyTorch attention
    monkeypatch.setenv("RELAYRL_KERNELS_OFF", "")
    monkeypatch.setenv("RELAYRL_KERNELS", "0")
    assert not cbuild.kernels_enabled("adamw_bf16")
