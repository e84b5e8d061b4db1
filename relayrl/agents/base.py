"""`Agent`: produces one trajectory (a `Sample`) from a prompt sample.

An agent owns the interaction pattern (one turn, reflection, tools); it calls the RolloutController
for tokens and a Judge for rewards. Agents are plain classes with one async method, so users write
new ones in a few lines and name them in the config by import path.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from relayrl.common.registry import Registry
from relayrl.engine.base import SamplingParams
from relayrl.engine.rollout import RolloutController
from relayrl.judge import Judge
from relayrl.sample import Sample


class Agent:
    """Base class: subclasses implement `generate_sample`."""

    def __init__(self, rollout_ctl: RolloutController, tokenizer, sampling: SamplingParams,
                 judge: Judge | None = None):
        self.rollout_ctl = rollout_ctl
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.judge = judge

    async def generate_sample(self, sample: Sample) -> Sample:
        raise NotImplementedError

    @classmethod
    def check_kwargs(cls, kwargs: dict[str, Any]) -> None:
        """Check the values of agent.kwargs before any model loads (their names are checked against `__init__`):
        raise an InputError whose message starts "agent.kwargs.NAME: ". Default: nothing more to check."""
        return

    def params_for(self, sample: Sample, turn: int = 0) -> SamplingParams:
        """Sampling params for one engine call: seeded per sample and turn when the sample has a seed."""
        if sample.seed is None:
            return self.sampling
        return replace(self.sampling, seed=(sample.seed * 1_000_003 + turn) % (2**63))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def close(self) -> None:
        """Release what the agent holds beyond the run's shared parts (a ToolAgent's MCP sessions); the run
        calls it once rollouts have stopped."""


# agent.kind's names: each built-in agent registers itself where it is defined (`@AGENTS.register("kind")`), and
# relayrl.agents imports its module
AGENTS: Registry[type[Agent]] = Registry("agent")
