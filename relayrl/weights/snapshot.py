"""`Weights`: what a trainer has to hand to the rollout side -- its policy's named tensors and their version.

The trainer exposes it (`TrainController.weights()`, rank 0's `LeaderController.weights()`) and never sees an
engine; the rollout side takes it (`RolloutSource.load_weights`, `RolloutController.load_weights`) and decides how
the tensors reach its engines: in place, through a folder, or by broadcast (relayrl.weights.transport).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

NamedTensors = Iterable[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class Weights:
    """The policy's weights at `version`: every parameter, or only the LoRA adapters of a peft model (the engines
    merge those into their base weights).

    `named_tensors` is a callable, not an iterable, because a weight sync reads the tensors more than once: each
    engine reads its own pass, and a pass costs something to start. A sharded (FSDP) trainer's pass gathers every
    parameter with a collective that all ranks must join once it starts, so a pass starts only when its reader is
    ready to read it to the end (relayrl.engine.rollout). The tensors may be the trainer's own storage: read them
    before the trainer steps again."""

    named_tensors: Callable[[], NamedTensors]
    version: int

    @classmethod
    def held(cls, tensors: list[tuple[str, torch.Tensor]], version: int) -> Weights:
        """Weights already in hand (received from another process): every pass reads the same list."""
        return cls(lambda: iter(tensors), version)
