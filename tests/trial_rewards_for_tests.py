"""Batched reward functions for the judge's start-up trial (tests/unit/test_reward_trial.py): each misbehaves on the
empty completions the trial passes, in one way. Standard library only: judge workers import this module before
they report ready."""

from __future__ import annotations

import os
import time
from typing import Any


def fixed_two(completions: list[Any], **kwargs: Any) -> list[float]:
    """Always two values, whatever the batch: right only for batches of two."""
    return [1.0, 1.0]


def text_values(completions: list[Any], **kwargs: Any) -> list[Any]:
    """The right count, but strings, not numbers."""
    return ["1.0"] * len(completions)


def first_word(completions: list[Any], **kwargs: Any) -> list[float]:
    """Raises IndexError on an empty completion (a parser that assumes a word), else 1.0."""
    return [float(bool(c.split()[0])) for c in completions]


def crash_on_empty(completions: list[Any], **kwargs: Any) -> list[float]:
    """Kills its worker on an empty completion."""
    if any(c == "" for c in completions):
        os._exit(3)
    return [1.0] * len(completions)


def hang_on_empty(completions: list[Any], **kwargs: Any) -> list[float]:
    """Hangs on an empty completion."""
    if any(c == "" for c in completions):
        time.sleep(100)
    return [1.0] * len(completions)


def nan_on_empty(completions: list[Any], **kwargs: Any) -> list[float]:
    """NaN on an empty completion (0/0 done in floats), else 1.0."""
    return [float("nan") if c == "" else 1.0 for c in completions]


def sees_rows(completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
    """Needs the rows' `answer` column: the trial must pass real rows. Right count, 0.0 each."""
    return [0.0 for _ in answer]
