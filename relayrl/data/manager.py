"""`DataManager`: the prompt side (a stateful dataloader) and the replay buffer of finished samples.

The dataloader is torchdata's StatefulDataLoader, so its position (epoch, shuffled order, RNG) can
be saved and restored with the rest of a checkpoint. `sample_from_dataset()` returns one GRPO group:
`group_size` samples of the same prompt sharing a group id.
"""

from __future__ import annotations

import uuid
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from relayrl.sample import Sample, Status


def _first(batch: list[Any]) -> Any:
    return batch[0]


class DataManager:
    def __init__(self, rows: list[dict[str, Any]], prompt_fn: Callable[[dict[str, Any]], list[int]], *,
                 group_size: int, shuffle: bool = True, seed: int = 0):
        self.rows, self.prompt_fn, self.group_size, self.seed = rows, prompt_fn, group_size, seed
        self._generator = torch.Generator().manual_seed(seed)
        with warnings.catch_warnings():  # torchdata 0.11 warns about its own deprecated torch call
            warnings.filterwarnings("ignore", message=".*set_vital.*")
            self.loader = StatefulDataLoader(rows, batch_size=1, shuffle=shuffle, collate_fn=_first,
                                             generator=self._generator)
        self._it = iter(self.loader)
        self.epoch = 0
        self.replay_buffer: list[Sample] = []

    def __len__(self) -> int:
        return len(self.rows)

    def _next_row(self) -> dict[str, Any]:
        try:
            return next(self._it)
        except StopIteration:
            self.epoch += 1
            # each epoch's order depends only on (seed, epoch), so a resumed run shuffles the same way
            self._generator.manual_seed(self.seed + self.epoch)
            self._it = iter(self.loader)
            return next(self._it)

    def sample_from_dataset(self) -> list[Sample]:
        """The next prompt as a group of `group_size` fresh samples."""
        row = self._next_row()
        prompt_ids = self.prompt_fn(row)
        gid = uuid.uuid4().hex[:12]
        return [Sample(prompt_ids=list(prompt_ids), data=row, group_id=gid, index=i)
                for i in range(self.group_size)]

    def reset(self) -> None:
        """Restart from the first prompt of the current order (used for a fixed eval pass)."""
        self._it = iter(self.loader)

    # ---- replay buffer ----------------------------------------------------------------------------
    def add_to_replay_buffer(self, samples: list[Sample]) -> None:
        self.replay_buffer.extend(samples)

    def get_batch(self) -> list[Sample]:
        """Take every completed sample from the buffer (marking them archived)."""
        batch = [s for s in self.replay_buffer if s.status == Status.COMPLETED]
        self.replay_buffer = [s for s in self.replay_buffer if s.status != Status.COMPLETED]
        for s in batch:
            s.status = Status.ARCHIVED
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"loader": self.loader.state_dict(), "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state["loader"])
        self.epoch = state["epoch"]
        self._it = iter(self.loader)
