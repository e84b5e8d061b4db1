"""Hardware-aware dtypes: engine.dtype auto is bf16 wherever bf16 is native (GPUs that have it, CPUs with
AVX512-BF16 or AMX unless the trainer is set to fp32) and float32 elsewhere; the trainer autocasts to bf16 wherever
bf16 is native; what the CPU does natively is measured once and reported."""

import json
import os
import subprocess
import sys

from relayrl.common import hardware
from relayrl.config.schema import load_run_config
from relayrl.run.build import resolve_precision

PROBE = "from relayrl.common.hardware import resolve_dtype; print(resolve_dtype('auto')[0])"


def _probe(tmp_path, **env) -> str:
    env = {**os.environ, "RELAYRL_CACHE": str(tmp_path), **env}
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_auto_is_float32_where_bf16_is_emulated(tmp_path):
    # how torch behaves on an AVX2-only CPU (bf16 matmul ~1 GFLOP/s): true on every x86 machine
    assert _probe(tmp_path, ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2") == "float32"


def test_auto_follows_the_measurement_and_caches_it(tmp_path):
    got = _probe(tmp_path)
    cache = tmp_path / "hardware.json"  # absent where the CPU's flags decided (no bf16 flag: nothing measured)
    entries = json.loads(cache.read_text()) if cache.exists() else {}
    model, flags = hardware._cpuinfo()
    if flags and not any(f in flags for f in ("avx512_bf16", "amx_bf16")):
        assert got == "float32" and not entries  # decided from the CPU flags, nothing to measure
        return
    (entry,) = entries.values()
    assert entry["bf16_gflops"] > 0 and entry["fp32_gflops"] > 0  # measured, reported
    assert got == ("bfloat16" if entry["bf16_gflops"] >= entry["fp32_gflops"] else "float32")
    # another switch setting is another machine as far as the cache goes
    _probe(tmp_path, ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2")
    assert len(json.loads((tmp_path / "hardware.json").read_text())) == 2


def test_cpu_without_bf16_flags_never_gets_bf16(monkeypatch):
    monkeypatch.setattr(hardware, "_cpuinfo", lambda: ("Old CPU", frozenset({"avx2", "fma"})))
    hardware.bf16_support.cache_clear()
    try:
        dtype, why = hardware.resolve_dtype("auto")
        assert dtype == "float32" and "no avx512_bf16" in why and "not native" in why
    finally:
        hardware.bf16_support.cache_clear()
    assert hardware.resolve_dtype("bfloat16") == ("bfloat16", "set in the config")


def _support(native: bool):
    return lambda device="cpu": hardware.Bf16Support(native, "simulated")


def test_trainer_autocast_follows_what_the_hardware_does_natively(monkeypatch, capsys):
    """auto: bf16 autocast in the trainer where bf16 is native (a bf16 engine, or a CPU with AVX512-BF16/AMX),
    fp32 where it is emulated; an explicit setting always wins."""
    monkeypatch.setattr(hardware, "bf16_support", _support(False))  # an AVX2 CPU
    assert resolve_precision(load_run_config(None, ["engine.dtype=bfloat16"])).model.autocast_bf16 is True
    assert resolve_precision(load_run_config(None, ["engine.dtype=float32"])).model.autocast_bf16 is False
    auto = resolve_precision(load_run_config(None, []))
    assert auto.engine.dtype == "float32" and auto.model.autocast_bf16 is False  # run.device auto: the CPU
    cfg = resolve_precision(load_run_config(None, ["engine.dtype=float32", "model.autocast_bf16=true"]))
    assert cfg.model.autocast_bf16 is True
    monkeypatch.setattr(hardware, "bf16_support", _support(True))  # AVX512-BF16 or AMX
    auto = resolve_precision(load_run_config(None, []))
    assert auto.engine.dtype == "bfloat16" and auto.model.autocast_bf16 is True  # bf16 engine, bf16 matmuls
    cfg = resolve_precision(load_run_config(None, ["model.autocast_bf16=false"]))
    assert cfg.engine.dtype == "float32" and cfg.model.autocast_bf16 is False  # an fp32 trainer: one fp32 model
    assert "precision: engine" in capsys.readouterr().out
