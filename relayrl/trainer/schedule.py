"""Learning-rate schedules over training steps: constant, linear or cosine decay, each with linear warmup.

A step is one `TrainController.fit` call (one policy version), the unit of `run.steps`, so
`train.total_steps` defaults to `run.steps` and the schedule does not depend on how many minibatch
updates a step makes. The schedule is stateless apart from its step count: it writes
`base_lr * factor(step)` into every optimizer it is given, so an optimizer replaced after
construction (or restored from a checkpoint) still follows it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def lr_factor(step: int, *, schedule: str, warmup: int = 0, total: int | None = None,
              min_ratio: float = 0.0) -> float:
    """Multiplier of the base learning rate at `step` (0-based: the step about to be trained).

    Warmup: (step + 1) / warmup for the first `warmup` steps, so the first step already learns.
    Then constant 1, or a decay from 1 (at step = warmup) towards min_ratio (at step = total):
    linear 1 - p, cosine (1 + cos(pi * p)) / 2, with p = (step - warmup) / (total - warmup).
    """
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    if total is None:
        raise ValueError(f"lr_schedule={schedule!r} needs total_steps")
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        decay = 1.0 - progress
    elif schedule == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown lr schedule {schedule!r} (expected constant, linear or cosine)")
    return min_ratio + (1.0 - min_ratio) * decay


class LRSchedule:
    """Sets each optimizer's lr to its base lr times `lr_factor` of the current step.

    The base lr is kept in each param group as "initial_lr" (torch's own convention), so it is saved
    and restored with the optimizer's state_dict.
    """

    def __init__(self, schedule: str = "constant", *, warmup: int = 0, total: int | None = None,
                 min_ratio: float = 0.0):
        lr_factor(0, schedule=schedule, warmup=warmup, total=total, min_ratio=min_ratio)  # fail early
        self.schedule, self.warmup, self.total, self.min_ratio = schedule, warmup, total, min_ratio
        self.step_count = 0

    def factor(self) -> float:
        return lr_factor(self.step_count, schedule=self.schedule, warmup=self.warmup, total=self.total,
                         min_ratio=self.min_ratio)

    def apply(self, optimizers: Iterable[torch.optim.Optimizer | None]) -> list[float]:
        """Write this step's lr into the optimizers; returns the lr of each one's first param group."""
        factor, lrs = self.factor(), []
        for opt in optimizers:
            if opt is None:
                continue
            for group in opt.param_groups:
                group.setdefault("initial_lr", group["lr"])
                group["lr"] = group["initial_lr"] * factor
            lrs.append(opt.param_groups[0]["lr"])
        return lrs

    def step(self) -> None:
        self.step_count += 1

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step_count}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step_count = int(state["step"])
