"""Model aliases: bare names for the models relayrl prepares itself. Known without importing torch, so that a
config naming one is checked in a launcher that never loads a model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from relayrl.models.smollm2 import SMOLLM2_ABOUT, prepare_smollm2, smollm2_dir

MODEL_ALIASES: dict[str, Callable[..., Path]] = {"smollm2": prepare_smollm2}  # prepares on first use
ALIAS_DIRS: dict[str, Callable[[], Path]] = {"smollm2": smollm2_dir}  # where it is (maybe not yet)
ALIAS_ABOUT: dict[str, str] = {"smollm2": SMOLLM2_ABOUT}  # where its weights come from (`relayrl models`)
