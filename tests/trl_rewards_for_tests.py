"""Reward functions written as TRL writes them, for tests/unit/test_trl_rewards.py (named by import path:
`judge.reward_fn=[trl_rewards_for_tests:format_reward, ...]`).

Standard library only, like rewards_for_tests: judge workers import this module before they report ready.
Each function records nothing and depends only on its arguments, so the tests can compute every reward by hand.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any


def _text(completion: Any) -> str:
    """A completion as text: TRL passes strings for standard prompts, [{"role", "content"}] for conversational."""
    return completion if isinstance(completion, str) else completion[0]["content"]


def format_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """1.0 if the completion ends with '!' (TRL's think_format_reward shape: completions and **kwargs)."""
    return [1.0 if _text(c).endswith("!") else 0.0 for c in completions]


def length_reward(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    """Length of the completion divided by 10."""
    return [len(_text(c)) / 10 for c in completions]


def answer_reward(prompts: list[Any], completions: list[Any], answer: list[str], **kwargs: Any) -> list[float | None]:
    """A dataset column by name: 1.0 if the completion contains the answer, None where the row has no answer."""
    return [None if a is None else float(a in _text(c)) for c, a in zip(completions, answer, strict=True)]


def only_named(completions: list[Any], answer: list[str]) -> list[float]:
    """No **kwargs: relayrl passes only what it names (TRL would raise on the other columns)."""
    return [float(a in c) for c, a in zip(completions, answer, strict=True)]


def none_reward(completions: list[Any], **kwargs: Any) -> list[float | None]:
    """No reward at all: every sample gets None."""
    return [None] * len(completions)


async def async_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """An async function (as an LLM judge over HTTP would be): 2.0 per '!' in the completion."""
    await asyncio.sleep(0.01)
    return [2.0 * _text(c).count("!") for c in completions]


def echo_reward(prompts: list[Any], completions: list[Any], completion_ids: list[Any], **kwargs: Any) -> list[float]:
    """0.5 per token id, and 100 if the completion came as a conversation (checks what TRL's arguments hold)."""
    return [0.5 * len(ids or []) + (100.0 if isinstance(c, list) else 0.0) for c, ids in zip(completions,
                                                                                             completion_ids,
                                                                                             strict=True)]


def batch_size_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """The size of the batch it was called with (to see how the judge batches)."""
    return [float(len(completions))] * len(completions)


def short_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """Returns one value too few: the judge must reject the batch and name this function and file."""
    return [1.0] * (len(completions) - 1)


def raising_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """Raises when any completion says 'boom'."""
    if any("boom" in _text(c) for c in completions):
        raise RuntimeError("boom in a completion")
    return [1.0] * len(completions)


def hanging_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """Hangs when any completion says 'hang'."""
    if any("hang" in _text(c) for c in completions):
        time.sleep(100)
    return [1.0] * len(completions)


def crashing_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """Kills its worker when any completion says 'crash'."""
    if any("crash" in _text(c) for c in completions):
        os._exit(3)
    return [1.0] * len(completions)


def nan_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """NaN for 'nan' completions (relayrl rejects NaN; only None means 'no reward')."""
    return [float("nan") if "nan" in _text(c) else 1.0 for c in completions]


def scalar_reward(completions: list[Any], **kwargs: Any) -> float:
    """Returns one number instead of a list."""
    return 1.0


def scaled_reward(completions: list[Any], scale: float, **kwargs: Any) -> list[float]:
    """judge.kwargs reach batched functions as plain values: scale per completion."""
    return [scale] * len(completions)


def needs_column(completions: list[Any], solution: list[str], **kwargs: Any) -> list[float]:
    """Requires a 'solution' column (the start-up check must name it when the rows lack it)."""
    return [float(s in c) for c, s in zip(completions, solution, strict=True)]
