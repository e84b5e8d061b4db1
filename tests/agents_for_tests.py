"""Agents and rewards that tests name by import path (configs refer to user code this way)."""

from __future__ import annotations

import asyncio
from typing import Any

from relayrl.agents.single_turn import SingleTurnAgent
from relayrl.sample import Sample


class FlakyAgent(SingleTurnAgent):
    """Raises for the first sample of every group and hangs for the second; the rest behave."""

    async def generate_sample(self, sample: Sample) -> Sample:
        if sample.index == 0:
            raise RuntimeError("user agent bug")
        if sample.index == 1:
            await asyncio.sleep(3600)
        return await super().generate_sample(sample)


def parity_reward(response: str, data: dict[str, Any]) -> dict[str, float]:
    """A dense, learnable-looking signal for random tiny models: even response length."""
    correct = float(len(response) % 2 == 0)
    return {"reward": correct, "correct": correct}
