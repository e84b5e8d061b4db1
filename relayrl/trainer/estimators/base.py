"""The advantage-estimator interface: what an estimator receives, what it returns, and what it declares.

An estimator turns a batch's shaped rewards into per-token advantages. It declares, in one place, what the rest
of the trainer must know about it: whether it compares a sample with its group (`group_relative`: groups then need
2 samples, and lone survivors are dropped), and whether it needs a critic (`needs_critic`: the controller builds
the value model and trains it on the returned `returns`). The controller does what is common to every estimator:
reward shaping before (overlong penalty, scale, bias, clip) and batch whitening after (algo.adv_mean/adv_std
"batch"), so an estimator is only the middle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from relayrl.common.errors import InputError
from relayrl.common.registry import Registry
from relayrl.config.algo import AlgoConfig
from relayrl.sample import Sample
from relayrl.trainer.algo import compute_advantages


@dataclass
class AdvantageInputs:
    """A batch as an estimator sees it. Rewards come as entries: one per sample, or one per (sample, turn) when an
    agent set a reward on every turn (the estimator's `turn_reward` field of each turn)."""

    samples: list[Sample]
    rewards: torch.Tensor  # shaped scalar reward of each entry
    entries: list[tuple[int, int | None]]  # (sample index, turn index; None: the whole sample) of each entry
    groups: list[str]  # group key of each entry (the prompt's group, and the turn under algo.turn_baseline=turn)
    values: list[torch.Tensor] | None = None  # critic V(s_t) per trained token of each sample (needs_critic only)
    # KL(pi_old || pi_ref) per trained token of each sample when it belongs in the reward (algo.kl_mode=reward,
    # kl_coef > 0, a reference model); None otherwise. The estimator puts algo.kl_coef times it into the reward.
    kl: list[torch.Tensor] | None = None

    @property
    def lengths(self) -> list[int]:
        """Trained tokens per sample: the length each returned advantage tensor must have."""
        return [s.num_trained_tokens for s in self.samples]

    def per_sample(self, per_entry: torch.Tensor) -> list[dict[int | None, float]]:
        """Each sample's entry values keyed by turn index (None: the whole sample)."""
        out: list[dict[int | None, float]] = [{} for _ in self.samples]
        for (i, j), v in zip(self.entries, per_entry.tolist(), strict=True):
            out[i][j] = v
        return out

    def to_tokens(self, per_entry: torch.Tensor) -> list[torch.Tensor]:
        """Per sample, per trained token: its sample's value, or its turn's value (entries per turn)."""
        return [_token_values(s, v) for s, v in zip(self.samples, self.per_sample(per_entry))]


@dataclass
class Advantages:
    """An estimator's result, per sample and per trained token."""

    advantages: list[torch.Tensor]
    returns: list[torch.Tensor] | None = None  # the critic's targets (an estimator that needs_critic sets them)


class AdvantageEstimator:
    """Base of every estimator: subclass it, override `estimate`, and register it
    (`@ESTIMATORS.register("name")` for a built-in) or name it by import path in algo.adv_estimator.

    The controller builds one per run, `cls(algo)`, so an estimator reads its knobs from `self.algo`.
    """

    needs_critic: ClassVar[bool] = False  # the controller builds a value model and gives `values`
    # the per-turn reward it reads: "reward" (the turn's return) or "step_reward" (the turn's own reward)
    turn_reward: ClassVar[Literal["reward", "step_reward"]] = "reward"

    def __init__(self, algo: AlgoConfig):
        self.algo = algo

    @property
    def group_relative(self) -> bool:
        """Whether advantages compare a sample with its group (GRPO, RLOO, ...): then a group needs 2 samples.
        The built-ins' group step is `group_baseline`, so this follows its knobs; an estimator that never compares
        within groups says False (a class attribute is enough)."""
        return self.algo.adv_mean in ("group", "group_batch") or self.algo.adv_std == "group"

    def group_baseline(self, inp: AdvantageInputs) -> torch.Tensor:
        """Per entry: the reward minus its group's baseline, over its group's scale (algo.adv_mean, adv_std,
        adv_leave_one_out; relayrl.trainer.algo.compute_advantages), or the reward as it is when neither is
        "group"."""
        a = self.algo
        return compute_advantages(inp.rewards, inp.groups,
                                  mean="group" if a.adv_mean in ("group", "group_batch") else "none",
                                  std="group" if a.adv_std == "group" else "none", leave_one_out=a.adv_leave_one_out)

    def estimate(self, inp: AdvantageInputs) -> Advantages:
        raise NotImplementedError(f"{type(self).__name__} must define estimate(inputs) -> Advantages")


ESTIMATORS: Registry[type[AdvantageEstimator]] = Registry("advantage estimator")


def estimator_for(algo: AlgoConfig) -> AdvantageEstimator:
    """The estimator algo.adv_estimator names (a registered name or "package.module:Class"), built for `algo`; an
    InputError naming the key if it names nothing or something else than an AdvantageEstimator subclass."""
    cls = ESTIMATORS.get(algo.adv_estimator, "algo.adv_estimator")
    if not (isinstance(cls, type) and issubclass(cls, AdvantageEstimator)):
        raise InputError(f"algo.adv_estimator: {algo.adv_estimator!r} is a {type(cls).__name__}, not a subclass of "
                         "relayrl.trainer.estimators.AdvantageEstimator")
    return cls(algo)


def _token_values(sample: Sample, values: dict[int | None, float]) -> torch.Tensor:
    """Per trained token: the sample's value (key None) or its turn's value (key = turn index)."""
    if None in values:
        return torch.full((sample.num_trained_tokens,), values[None])
    by_position = torch.zeros(len(sample.response_ids))
    for j, turn in enumerate(sample.turns):
        by_position[turn.start: turn.end] = values[j]
    return by_position[torch.tensor(sample.loss_mask, dtype=torch.bool)]
