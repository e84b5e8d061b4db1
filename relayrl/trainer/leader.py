"""Data-parallel training under `relayrl train`: rank 0 leads, the other ranks follow.

With `train.engine=fsdp` the trainer runs on N processes (torchrun). Only rank 0 runs the RL loop (engines,
agents, judge, logs); the other ranks hold their FSDP shards and do what rank 0 does to the trainer, in the
same order, because every FSDP call is a collective: fit the same batch, gather the full weights for a sync or
an export, write or load a checkpoint's shards (relayrl.run.checkpoint_dist). Rank 0's `LeaderController`
broadcasts each such command before running it; `follow()` is the other ranks' whole program. The loop code is
unchanged: it talks to a LeaderController as to a TrainController.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from relayrl.trainer.controller import TrainController
from relayrl.trainer.engine import TrainEngine
from relayrl.trainer.shards import load_shards, save_shards
from relayrl.trainer.value import Critic
from relayrl.weights.snapshot import Weights


def _send(command: str, payload: Any = None) -> None:
    dist.broadcast_object_list([(command, payload)], src=0)


def _receive() -> tuple[str, Any]:
    box: list = [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class _LeaderEngine:
    """Rank 0's view of the FSDPEngine: a full-weight gather is announced to the followers first. It declares what
    the loops and checkpointing use of a trainer's engine (relayrl.run.components, relayrl.run.checkpoint)."""

    def __init__(self, engine: TrainEngine):
        self._engine = engine

    @property
    def model(self) -> torch.nn.Module:
        return self._engine.model

    @property
    def sharded(self) -> bool:
        return self._engine.sharded

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        _send("gather")
        return self._engine.named_parameters()


class LeaderController:
    """A TrainController on rank 0 whose collective calls are mirrored by the followers. It declares every member the
    loops and checkpointing use of a TrainController (the rest of the controller is the trainer's own business)."""

    def __init__(self, ctl: TrainController):
        self._ctl = ctl
        self.engine = _LeaderEngine(ctl.engine)

    @property
    def version(self) -> int:
        return self._ctl.version

    @property
    def critic(self) -> Critic | None:
        return self._ctl.critic

    def state_dict(self) -> dict:
        return self._ctl.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._ctl.load_state_dict(state)

    def fit(self, samples) -> dict[str, float]:
        _send("fit", samples)
        return self._ctl.fit(samples)

    def weights(self) -> Weights:
        """The policy's weights for the rollout side: each pass it reads gathers them whole, the followers joining
        (`_LeaderEngine.named_parameters`)."""
        return Weights(self.engine.named_parameters, self._ctl.version)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's weights gathered whole (every rank takes part), for an export."""
        return dict(self.engine.named_parameters())

    def save_checkpoint(self, folder: Path) -> list[dict]:
        """Every rank writes its shard of the policy and its optimizer into `folder` (shared by all ranks).
        Returns every rank's generators (relayrl.trainer.shards.save_shards)."""
        _send("save", str(folder))
        return save_shards(self._ctl, folder)

    def load_checkpoint(self, folder: Path) -> None:
        """Every rank loads its slice of a sharded checkpoint's trainer state."""
        _send("load", str(folder))
        load_shards(self._ctl, folder)

    def stop_followers(self) -> None:
        stop_followers()


def lead(ctl: TrainController | LeaderController) -> LeaderController:
    """Rank 0's controller from its first collective on; a controller already led is returned as it is (a
    resume leads it at build time, the loop again after)."""
    return ctl if isinstance(ctl, LeaderController) else LeaderController(ctl)


def stop_followers() -> None:
    """End the followers' `follow()`. Also sent when rank 0 fails before it leads anything (say, while building
    the run), since the followers would otherwise wait for its first command forever."""
    _send("stop")


def follow(ctl: TrainController) -> None:
    """The program of ranks > 0: mirror rank 0's trainer calls until it says stop."""
    while True:
        command, payload = _receive()
        if command == "fit":
            ctl.fit(payload)
        elif command == "gather":
            for _ in ctl.engine.named_parameters():
                pass
        elif command == "save":
            save_shards(ctl, Path(payload))
        elif command == "load":
            load_shards(ctl, Path(payload))
        elif command == "stop":
            return
        else:
            raise RuntimeError(f"unknown command from rank 0: {command!r}")
