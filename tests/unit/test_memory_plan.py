"""model.gradient_checkpointing "auto" and the start line that states the trainer's memory floor and settings."""

from __future__ import annotations

import pytest

import relayrl.run.resolve as run_resolve
from relayrl.common.memory import TIGHT_FLOOR_SHARE, memory_is_tight
from relayrl.config.schema import load_run_config
from relayrl.models import load_model
from relayrl.run.build import _memory_plan
from relayrl.run.resolve import resolve
from relayrl.trainer.engine import TrainEngine


def test_memory_is_tight_from_a_fifth_of_the_memory_up():
    assert TIGHT_FLOOR_SHARE == 0.2
    assert memory_is_tight(20, 100) and memory_is_tight(50, 100)
    assert not memory_is_tight(19, 100)
    assert not memory_is_tight(10**12, None)  # unknown memory: keep the fast settings


def test_auto_checkpointing_follows_the_floor_against_the_device_memory(tiny_path, monkeypatch):
    """Decided at start-up from the parameters the folder stores (relayrl.run.resolve), before the model loads."""
    model = load_model(tiny_path, dtype="float32")
    floor = 16 * sum(p.numel() for p in model.parameters())
    over = [f"model.path={tiny_path}", "model.train_dtype=float32"]
    assert resolve(load_run_config(None, over), quiet=True).model.gradient_checkpointing is False  # tiny vs this RAM
    # the same model on a device whose memory is 4x its floor (25%): tight, so checkpointing goes on
    monkeypatch.setattr(run_resolve, "device_memory_bytes", lambda device: 4 * floor)
    cfg = resolve(load_run_config(None, over), quiet=True)
    assert cfg.model.gradient_checkpointing is True
    assert cfg.resolved["model.gradient_checkpointing"]["why"].startswith(f"auto: training floor {floor / 1e9:.2f} GB")
    set_off = resolve(load_run_config(None, [*over, "model.gradient_checkpointing=false"]), quiet=True)
    assert set_off.model.gradient_checkpointing is False  # set wins
    engine = TrainEngine(model, gradient_checkpointing=cfg.model.gradient_checkpointing)
    assert engine.gradient_checkpointing is True and model.is_activation_checkpointing
    with pytest.raises(TypeError, match="resolved at start-up"):  # an "auto" never reaches an engine
        TrainEngine(model, gradient_checkpointing="auto")


@pytest.mark.parametrize("setting, expect", [("auto", "gradient checkpointing off (auto)"),
                                             ("true", "gradient checkpointing on (set)")])
def test_the_memory_line_states_the_floor_and_the_settings(tiny_path, setting, expect):
    cfg = resolve(load_run_config(None, [f"model.path={tiny_path}", f"model.gradient_checkpointing={setting}"]),
                  quiet=True)
    engine = TrainEngine(load_model(tiny_path), gradient_checkpointing=cfg.model.gradient_checkpointing)
    line = _memory_plan(cfg, engine)
    floor_gb = engine.floor_bytes / 1e9
    assert line.startswith(f"memory: training floor {floor_gb:.2f} GB (16 bytes/trainable param) = 0% of ")
    assert expect in line and "glibc's heap (auto)" in line
