"""Every automatic choice made once at start-up (relayrl.run.resolve): what components read has no "auto" left
(but the documented engine.attention rule on a CPU), config.yaml records what was asked beside what was decided,
and a run's config.yaml, new or from before the record existed, loads and compares on resume."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import yaml

import relayrl
import relayrl.models.loading as loading
import relayrl.run.resolve as run_resolve
from relayrl.config import ConfigError
from relayrl.config.schema import RESOLVED_KEYS, load_run_config
from relayrl.run import checkpoint
from relayrl.run.build import _run_folder, _train_controller, make_engines
from relayrl.run.resolve import resolve

EVERY_AUTO = ["engine.dtype=auto", "engine.kv_dtype=auto", "engine.attention=auto", "model.train_dtype=auto",
              "model.autocast_bf16=auto", "model.gradient_checkpointing=auto", "run.device=auto",
              "algo.rollout_correction.enabled=auto"]
REMOTE = ["engine.kind=remote", "engine.addresses=[http://127.0.0.1:1]", "engine.weight_sync=distributed",
          "engine.weight_sync_backend=auto"]


def _sections(cfg) -> dict:
    """The values components read, by dotted key (run.device's: Config.device)."""
    sections = {k: functools.reduce(getattr, k.split("."), cfg) for k in RESOLVED_KEYS if k != "run.device"}
    return sections | {"run.device": cfg.device}


def test_every_auto_resolves_to_a_concrete_value_recorded_with_its_reason(tiny_path, capsys):
    for over, absent in (([], "engine.weight_sync_backend"), (REMOTE, None)):
        cfg = resolve(load_run_config(None, [f"model.path={tiny_path}", *EVERY_AUTO, *over]))
        values = _sections(cfg)
        for key, entry in cfg.resolved.items():
            assert entry["value"] == values[key] and entry["why"], key
        if absent is None:  # remote engines: their choices; the local engine's are not made
            assert {"engine.kv_dtype", "engine.attention"}.isdisjoint(cfg.resolved)
            assert cfg.engine.weight_sync_backend == ("nccl" if torch.cuda.is_available() else "gloo")
            continue
        assert set(cfg.resolved) == set(RESOLVED_KEYS) - {absent}
        assert all(e["asked"] == "auto" for e in cfg.resolved.values())
        auto_left = {k for k, v in values.items() if v == "auto"} - {absent}  # a remote key: nothing local reads it
        assert auto_left == ({"engine.attention"} if cfg.device == "cpu" else set())  # the engine's own rule
        assert cfg.engine.kv_dtype == cfg.engine.dtype  # the KV cache in the engine's dtype
        assert isinstance(cfg.model.gradient_checkpointing, bool) and cfg.run.device == "auto"  # stays as asked
    out = capsys.readouterr().out
    assert out.count("precision: engine") == 2 and out.count("rollout correction:") == 2  # once per start-up
    resolve(load_run_config(None, [f"model.path={tiny_path}"]), quiet=True)
    assert capsys.readouterr().out == ""  # a producer process, a follower rank


def test_decisions_that_need_no_model(monkeypatch):
    """engine.attention on a GPU is sdpa (the kernel reads CPU memory); FSDP GPU ranks hold a share of the floor."""
    cfg = load_run_config(None, [])
    record: dict = {}
    out = run_resolve._engine(cfg, torch.device("cuda"), record)
    assert out.engine.attention == "sdpa" and "CPU memory" in record["engine.attention"]["why"]
    params = 10**9  # a 16 GB fp32 floor
    monkeypatch.setattr(run_resolve, "device_memory_bytes", lambda device: 64 * 10**9)  # 25%: tight
    fsdp = load_run_config(None, ["train.engine=fsdp", "model.train_dtype=float32"])
    assert run_resolve._checkpointing(fsdp, torch.device("cpu"), params, {}).model.gradient_checkpointing is True
    monkeypatch.setenv("WORLD_SIZE", "4")  # 4 GB a GPU rank: 6%
    assert run_resolve._checkpointing(fsdp, torch.device("cuda"), params, {}).model.gradient_checkpointing is False


def test_components_read_the_resolved_device_only(tiny_run, monkeypatch):
    """After the resolution step nothing resolves run.device again: the trainer and the engine load on
    Config.device (a concrete device; load_model only checks it)."""
    cfg = resolve(tiny_run(), quiet=True)
    seen = []
    check = loading.resolve_device

    def concrete_only(setting):
        seen.append(setting)
        assert setting != "auto", "run.device resolved again after start-up"
        return check(setting)

    def refuse(setting):
        raise AssertionError("resolve_device called after the resolution step")

    monkeypatch.setattr(loading, "resolve_device", concrete_only)
    monkeypatch.setattr(run_resolve, "resolve_device", refuse)
    train_ctl = _train_controller(cfg, cfg.model.path, 0)
    (engine,) = make_engines(cfg, cfg.model.path, [0], None, [])
    engine.close()
    assert seen and "auto" not in seen and train_ctl.engine.device.type == cfg.device
    with pytest.raises(RuntimeError, match="not resolved"):
        make_engines(tiny_run(), cfg.model.path, [0], None, [])  # an unresolved config is refused, not guessed


def test_config_yaml_holds_what_was_asked_and_what_was_resolved(tiny_run, tmp_path):
    cfg = resolve(tiny_run(**{"model.gradient_checkpointing": "auto"}), quiet=True)
    run_dir, _, _, lock = _run_folder(cfg, resume=False)
    lock.release()
    written = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert written["resolved"]["model.gradient_checkpointing"]["asked"] == "auto"
    assert written["resolved"]["model.gradient_checkpointing"]["value"] is False
    assert written["resolved"]["engine.dtype"] == {"asked": "float32", "value": "float32", "why": "set in the config"}
    assert written["resolved"]["run.device"]["value"] == cfg.device and written["run"]["device"] == "auto"
    # the run's config.yaml loads as a config (relayrl eval of a run, a rerun), and start-up decides anew
    again = resolve(load_run_config(str(run_dir / "config.yaml")), quiet=True)
    assert _sections(again) == _sections(cfg)
    # an older run's config.yaml, written before `resolved` existed, loads and resumes without spurious changes
    old = {k: v for k, v in written.items() if k != "resolved"}
    ckpt = tmp_path / "step_1"
    ckpt.mkdir()
    (ckpt / "config.yaml").write_text(yaml.safe_dump(old))
    assert load_run_config(str(ckpt / "config.yaml")).resolved == {}
    assert checkpoint.config_changes(cfg, ckpt) == []
    assert checkpoint.config_changes(resolve(tiny_run(**{"train.lr": 0.5}), quiet=True), ckpt) == ["train.lr"]


def test_a_resolved_section_written_by_hand_is_refused_by_name(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("resolved:\n  engine.dtype: {asked: auto}\n")
    with pytest.raises(ConfigError, match="resolved.engine.dtype: must have asked, value and why"):
        load_run_config(str(path))
    path.write_text("resolved:\n  engine.speed: {asked: auto, value: 1, why: x}\n")
    with pytest.raises(ConfigError, match="resolved.engine.speed: not a choice relayrl resolves"):
        load_run_config(str(path))


def test_run_device_is_resolved_in_one_place():
    """Nothing but the resolution step turns run.device into a device; the other callers resolve something else:
    common/device.py defines it, load_model checks the concrete device it is given, `relayrl serve` resolves its own
    --device, and the FSDP launch picks its process group's backend before start-up (relayrl.run.loop)."""
    root = Path(relayrl.__file__).parent
    callers = {p.relative_to(root).as_posix() for p in root.rglob("*.py") if "resolve_device(" in p.read_text()}
    assert callers == {"run/resolve.py", "common/device.py", "models/loading.py", "serve/server.py", "run/loop.py"}
