"""Reward functions that tests name by import path (`judge.reward_fn=rewards_for_tests:parity_reward`).

Standard library only, on purpose: every judge worker is a fresh spawned interpreter that imports the reward
function's module before it reports ready, and a build waits for that. agents_for_tests imports relayrl's
agents (torch, transformers, openai: about 4 s of a worker's start on 2 cores); this module imports in
milliseconds, so each tiny run's build no longer waits on it."""

from __future__ import annotations

from typing import Any


def parity_reward(response: str, data: dict[str, Any]) -> dict[str, float]:
    """A dense, learnable-looking signal for random tiny models: even response length."""
    correct = float(len(response) % 2 == 0)
    return {"reward": correct, "correct": correct}


def tagged_reward(response: str, data: dict[str, Any]) -> float:
    """Misbehaves by the row's tag: NAN -> NaN, HUGE -> 1e9 (beyond judge.max_abs_reward); else even length."""
    if "NAN" in data["question"]:
        return float("nan")
    if "HUGE" in data["question"]:
        return 1e9
    return float(len(response) % 2 == 0)
