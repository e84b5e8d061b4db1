"""Hardware-aware dtypes: engine.dtype auto is bf16 wherever bf16 is native (GPUs that have it, CPUs with
AVX512-BF16 or AMX unless the trainer is set to fp32) and float32 elsewhere; the trainer autocasts to bf16 wherever
bf16 is native; what the CPU does natively is measured once and reported."""

import json
import os
import subprocess
import sys

import torch
from bounds import bound

from relayrl.common import hardware
from relayrl.config.schema import load_run_config
from relayrl.run.resolve import resolve

PROBE = "from relayrl.common.hardware import resolve_dtype; print(resolve_dtype('auto')[0])"


def _probe(tmp_path, **env) -> str:
    """resolve_dtype('auto') in a fresh process with the cache in tmp_path and only the ISA switches in `env` (the
    suite itself may run under them: as AVX2)."""
    plain = {k: v for k, v in os.environ.items() if k not in hardware._ENV_SWITCHES}
    env = {**plain, "RELAYRL_CACHE": str(tmp_path), **env}
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
    assert resolve(load_run_config(None, ["engine.dtype=bfloat16"])).model.autocast_bf16 is True
    assert resolve(load_run_config(None, ["engine.dtype=float32"])).model.autocast_bf16 is False
    auto = resolve(load_run_config(None, []))
    assert auto.engine.dtype == "float32" and auto.model.autocast_bf16 is False  # run.device auto: the CPU
    cfg = resolve(load_run_config(None, ["engine.dtype=float32", "model.autocast_bf16=true"]))
    assert cfg.model.autocast_bf16 is True
    monkeypatch.setattr(hardware, "bf16_support", _support(True))  # AVX512-BF16 or AMX
    auto = resolve(load_run_config(None, []))
    assert auto.engine.dtype == "bfloat16" and auto.model.autocast_bf16 is True  # bf16 engine, bf16 matmuls
    cfg = resolve(load_run_config(None, ["model.autocast_bf16=false"]))
    assert cfg.engine.dtype == "float32" and cfg.model.autocast_bf16 is False  # an fp32 trainer: one fp32 model
    assert "precision: engine" in capsys.readouterr().out


AMX = frozenset({"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"})
GOOD = {"fp32_gflops": 150.0, "bf16_gflops": 600.0, "threads": 1}


def _fake_cpu(monkeypatch, tmp_path, measurements: list[dict]) -> list[dict]:
    """An AMX CPU whose matmul probe returns `measurements` in turn (what a machine under load measures); the
    cache in tmp_path; no ISA switch. Returns the list of what was measured."""
    monkeypatch.setenv("RELAYRL_CACHE", str(tmp_path))
    for k in hardware._ENV_SWITCHES:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(hardware, "_cpuinfo", lambda: ("Test Xeon", AMX))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    queue, taken = list(measurements), []
    monkeypatch.setattr(hardware, "_measure", lambda: taken.append(queue.pop(0)) or dict(taken[-1]))
    monkeypatch.setattr(hardware, "_uncached", {})
    hardware.bf16_support.cache_clear()
    return taken


def test_a_measurement_below_the_isas_floor_is_taken_again_and_only_a_plausible_one_is_cached(monkeypatch, tmp_path):
    loaded = {"fp32_gflops": 4.0, "bf16_gflops": 500.0, "threads": 1}  # what the AMX Xeon once cached
    taken = _fake_cpu(monkeypatch, tmp_path, [loaded, GOOD])
    try:
        support = hardware.bf16_support("cpu")
    finally:
        hardware.bf16_support.cache_clear()
    assert len(taken) == 2 and support.native and "measured now, cached" in support.reason
    (entry,) = json.loads((tmp_path / "hardware.json").read_text()).values()
    assert entry["fp32_gflops"] == 150.0 and entry["bf16_gflops"] == 600.0  # the best of the two tries


def test_bf16_slower_than_fp32_on_an_amx_cpu_is_never_cached_and_the_flags_decide(monkeypatch, tmp_path):
    slow = {"fp32_gflops": 150.0, "bf16_gflops": 90.0, "threads": 1}
    taken = _fake_cpu(monkeypatch, tmp_path, [slow] * hardware.PROBE_ATTEMPTS)
    try:
        support = hardware.bf16_support("cpu")
    finally:
        hardware.bf16_support.cache_clear()
    assert len(taken) == hardware.PROBE_ATTEMPTS
    assert support.native and "not cached, going by the CPU flags" in support.reason
    assert "bf16 measured slower than fp32 on a CPU with avx512_bf16/amx_bf16" in support.reason
    assert not (tmp_path / "hardware.json").exists()
    entry, why = hardware.probe(AMX)  # asked again in the same process (the doctor asks twice): no new tries
    assert len(taken) == hardware.PROBE_ATTEMPTS and why is not None and entry["source"] == "measured now, not cached"


def test_an_isa_switch_makes_slow_bf16_plausible(monkeypatch, tmp_path):
    emulated = {"fp32_gflops": 150.0, "bf16_gflops": 1.2, "threads": 1}
    _fake_cpu(monkeypatch, tmp_path, [emulated])
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # bf16 emulated on purpose: believed, cached
    assert hardware.implausible(emulated, AMX) is None
    try:
        assert not hardware.bf16_support("cpu").native
    finally:
        hardware.bf16_support.cache_clear()
    assert (tmp_path / "hardware.json").exists()


def test_a_cached_entry_that_disagrees_with_the_flags_is_measured_anew(monkeypatch, tmp_path):
    taken = _fake_cpu(monkeypatch, tmp_path, [GOOD])
    key = hardware._cache_key(*hardware._cpuinfo())
    stale = {"fp32_gflops": 4.0, "bf16_gflops": 500.0, "threads": 1, "measured_at": 0.0}
    (tmp_path / "hardware.json").write_text(json.dumps({key: stale}))
    entry, why = hardware.probe(AMX)
    assert why is None and len(taken) == 1 and entry["fp32_gflops"] == 150.0


def test_a_measurement_taken_on_a_busy_machine_expires_and_versions_key_the_cache(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    busy, idle = hardware._stamp(3.0), hardware._stamp(0.2)
    assert busy["expires_at"] == busy["measured_at"] + hardware.BUSY_TTL_S and "expires_at" not in idle
    monkeypatch.setenv("RELAYRL_CACHE", str(tmp_path))
    (tmp_path / "hardware.json").write_text(json.dumps({"a": {"x": 1, "expires_at": 1.0}, "b": {"x": 2}}))
    assert hardware._read_cache() == {"b": {"x": 2}}  # the expired one is not read
    model, flags = hardware._cpuinfo()
    before = hardware._cache_key(model, flags)
    monkeypatch.setattr(hardware, "_relayrl_version", lambda: "99.0")
    assert hardware._cache_key(model, flags) != before  # another relayrl measures anew


def test_the_real_probe_measures_one_thread_with_a_warm_up_and_is_plausible_here():
    m = hardware._measure()
    assert m["threads"] == 1 and m["fp32_gflops"] > 0 and m["bf16_gflops"] > 0
    model, flags = hardware._cpuinfo()
    if not any(f in flags for f in ("avx512_bf16", "amx_bf16")):
        return
    isa = torch.backends.cpu.get_cpu_capability()
    assert m["fp32_gflops"] >= hardware.FP32_FLOOR_PER_THREAD.get(isa, 0.0), m  # one core, even under load


def test_doctor_prints_what_was_measured_and_chosen(tmp_path):
    env = {**os.environ, "RELAYRL_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "relayrl.cli", "doctor", "--remeasure"], env=env,
                         capture_output=True, text=True, timeout=bound(300))
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    for needle in ("cpu: ", "cpu flags: ", "isa switches: ", "bf16 native: ", "engine.dtype auto -> ",
                   "model.autocast_bf16 auto -> ", "c kernels: built -march=", "norm_swiglu: ok", "cache: "):
        assert needle in text, text
    model, flags = hardware._cpuinfo()
    march = "x86-64-v3" if os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "avx2" else "native"
    assert f"c kernels: built -march={march} " in text, text  # the target torch's ISA restriction implies
    if any(f in flags for f in ("avx512_bf16", "amx_bf16")):
        assert "matmul 256x256: fp32 " in text and "plausible: " in text
    else:
        assert "matmul probe: not run" in text
