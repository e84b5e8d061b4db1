"""`DataManager`: the prompt side (a stateful dataloader) and the replay buffer of finished samples.

The dataloader is torchdata's StatefulDataLoader, so its position (epoch, shuffled order, RNG) can
be saved and restored with the rest of a checkpoint. `sample_from_dataset()` returns one GRPO group:
`group_size` samples of the same prompt sharing a group id. The replay buffer holds finished groups
first in, first out; it is thread-safe because an asynchronous producer fills it from its own thread
while the trainer takes batches.

Prompts come back when their groups were not trained: `requeue` puts one in front of the dataset (generated
again first), `set_aside` into the tail pool (an asynchronous scheduler's tail batch, relayrl.scheduler.asynchronous).
Each carries how many times its groups expired; a drawn group's samples say so in `metrics[EXPIRED_BEFORE]`.
"""

from __future__ import annotations

import threading
import time
import uuid
import warnings
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from relayrl.data.images import IMAGES
from relayrl.sample import Sample, Status

EXPIRED_BEFORE = "expired_before"  # Sample.metrics key: times this prompt's earlier groups expired (absent: none)


def _first(batch: list[Any]) -> Any:
    return batch[0]


class ReplayBuffer:
    """Finished groups of samples, oldest first. `take` blocks until enough groups are there, and re-raises
    a producer's failure in the waiting trainer instead of letting it wait forever."""

    def __init__(self):
        self._groups: deque[list[Sample]] = deque()
        self._cond = threading.Condition()
        self._error: BaseException | None = None

    def __len__(self) -> int:
        return len(self._groups)

    @property
    def error(self) -> BaseException | None:
        return self._error

    def put(self, group: list[Sample]) -> None:
        with self._cond:
            self._groups.append(group)
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def take(self, n_groups: int | None = None, timeout: float | None = None) -> list[list[Sample]]:
        """The oldest n groups (all of them if n is None, without waiting)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while n_groups is not None and len(self._groups) < n_groups:
                if self._error is not None:
                    raise RuntimeError("the rollout producer failed") from self._error
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"waited {timeout}s for {n_groups} groups, have {len(self._groups)}")
                self._cond.wait(timeout=1.0 if left is None else min(left, 1.0))
            n = len(self._groups) if n_groups is None else n_groups
            return [self._groups.popleft() for _ in range(n)]

    def groups(self) -> list[list[Sample]]:
        with self._cond:
            return list(self._groups)


class DataManager:
    def __init__(self, rows: list[dict[str, Any]], prompt_fn: Callable[[dict[str, Any]], list[int]], *,
                 group_size: int, shuffle: bool = True, seed: int = 0, seed_samples: bool = True):
        self.rows, self.prompt_fn, self.group_size, self.seed = rows, prompt_fn, group_size, seed
        self._generator = torch.Generator().manual_seed(seed)
        with warnings.catch_warnings():  # torchdata 0.11 warns about its own deprecated torch call
            warnings.filterwarnings("ignore", message=".*set_vital.*")
            self.loader = StatefulDataLoader(rows, batch_size=1, shuffle=shuffle, collate_fn=_first,
                                             generator=self._generator)
        self._it = iter(self.loader)
        self.epoch = 0
        self.drawn = 0  # prompts handed out so far: with the run seed, it seeds each sample's sampling
        self.seed_samples = seed_samples
        self.replay_buffer = ReplayBuffer()
        # (row, expiries): prompts to generate again first (expired groups), and those set aside for a tail batch
        self._requeued: deque[tuple[dict[str, Any], int]] = deque()
        self._tail: deque[tuple[dict[str, Any], int]] = deque()

    def __len__(self) -> int:
        return len(self.rows)

    def _next_row(self) -> tuple[dict[str, Any], int]:
        if self._requeued:
            return self._requeued.popleft()
        try:
            return next(self._it), 0
        except StopIteration:
            self.epoch += 1
            # each epoch's order depends only on (seed, epoch), so a resumed run shuffles the same way
            self._generator.manual_seed(self.seed + self.epoch)
            self._it = iter(self.loader)
            return next(self._it), 0

    def sample_from_dataset(self) -> list[Sample]:
        """The next prompt as a group of `group_size` fresh samples: a requeued one first, else the dataset's next."""
        return self._group(*self._next_row())

    def sample_from_tail(self) -> list[Sample]:
        """The oldest prompt set aside for the tail batch, as a fresh group (IndexError if there is none)."""
        return self._group(*self._tail.popleft())

    @property
    def tail_size(self) -> int:
        """Prompts set aside for the tail batch."""
        return len(self._tail)

    def _group(self, row: dict[str, Any], expiries: int) -> list[Sample]:
        prompt_ids = self.prompt_fn(row)
        gid = uuid.uuid4().hex[:12]
        base = (self.seed * 1_000_003 + self.drawn) * 997 if self.seed_samples else None
        self.drawn += 1
        metrics = {EXPIRED_BEFORE: float(expiries)} if expiries else {}
        return [Sample(prompt_ids=list(prompt_ids), data=row, group_id=gid, index=i, metrics=dict(metrics),
                       seed=None if base is None else base + i, images=list(row.get(IMAGES) or []))
                for i in range(self.group_size)]

    def reset(self) -> None:
        """Restart from the first prompt of the current order with the same sample seeds (a fixed eval
        pass: evaluations before and after training then share their random numbers)."""
        self._it = iter(self.loader)
        self.drawn = 0

    def requeue(self, row: dict[str, Any], expiries: int = 0) -> None:
        """Generate this prompt again before any new one (its group expired `expiries` times, or was cut short)."""
        self._requeued.append((row, expiries))

    def set_aside(self, row: dict[str, Any], expiries: int) -> None:
        """Keep this prompt for the tail batch (its groups expired `expiries` times): not generated until one runs."""
        self._tail.append((row, expiries))

    # ---- replay buffer ----------------------------------------------------------------------------
    def add_to_replay_buffer(self, samples: list[Sample]) -> None:
        """Add one group's finished samples (those not COMPLETED are left out)."""
        done = [s for s in samples if s.status == Status.COMPLETED]
        if done:
            self.replay_buffer.put(done)

    def get_batch(self, n_groups: int | None = None, timeout: float | None = None) -> list[Sample]:
        """Take the oldest n groups (every buffered group if None), waiting for them; marks them archived.

        The groups come out in the order they were drawn (their seeds grow with it), not the order they happened
        to finish in: the batch order decides how micro-batches are packed and so the float rounding of the
        update, and a run must not depend on which of two groups won a race (exact resume relies on it).
        """
        groups = self.replay_buffer.take(n_groups, timeout)
        groups.sort(key=lambda g: -1 if g[0].seed is None else g[0].seed)  # stable: unseeded keep arrival order
        batch = [s for group in groups for s in group]
        for s in batch:
            s.status = Status.ARCHIVED
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The dataloader position (epoch, shuffled order, rows yielded), the drawn counter that seeds sampling,
        and the prompts waiting to be generated again or set aside (with their expiry counts). Take it while no
        producer is drawing prompts."""
        return {"loader": self.loader.state_dict(), "epoch": self.epoch, "drawn": self.drawn,
                "requeued": [row for row, _ in self._requeued], "expiries": [n for _, n in self._requeued],
                "tail": [[row, n] for row, n in self._tail], "generator": self._generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state["loader"])
        self.epoch, self.drawn = state["epoch"], state.get("drawn", 0)
        rows = state.get("requeued", [])
        self._requeued = deque(zip(rows, state.get("expiries", [0] * len(rows)), strict=True))
        self._tail = deque((row, n) for row, n in state.get("tail", []))
        if "generator" in state:
            self._generator.set_state(state["generator"])
        self._it = iter(self.loader)
