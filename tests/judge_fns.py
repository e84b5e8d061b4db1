"""Reward functions that misbehave on purpose, for tests/unit/test_judge.py.

They live in a real module because Judge workers are separate processes that import the reward function
by path; test_judge.py puts this directory on sys.path, and spawned workers inherit sys.path.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

NOT_CALLABLE = 42


def misbehave(response: str, data: dict[str, Any]) -> Any:
    """Fail in the way `data["mode"]` names; mode "ok" returns a reward dict with extra metrics."""
    mode = data.get("mode", "ok")
    if mode == "raise":
        raise ZeroDivisionError("boom\nsecond line")
    if mode == "hang":
        time.sleep(100)
    if mode == "exit":
        os._exit(1)
    if mode == "segfault":
        os.kill(os.getpid(), signal.SIGSEGV)
    if mode == "string":
        return "1.0"
    if mode == "nan":
        return float("nan")
    if mode == "inf":
        return {"reward": float("-inf")}
    if mode == "huge":
        return 1e30
    if mode == "allocate":  # far beyond any test's judge.memory_mb
        return len(bytearray(2**30))
    if mode == "no_reward_key":
        return {"correct": 1.0}
    return {"reward": 0.5, "correct": True, "n_chars": len(response), "note": "not a number: dropped"}


def length_reward(response: str, data: dict[str, Any], scale: float = 1.0) -> float:
    return scale * len(response)


def echo(x: Any) -> Any:
    return x


def divide(a: float, b: float) -> float:
    return a / b


def sleep_then(seconds: float, value: Any) -> Any:
    time.sleep(seconds)
    return value


def worker_pid() -> int:
    return os.getpid()


def sigint_handler() -> str:
    """How the worker treats SIGINT: Ctrl-C in a terminal reaches the whole process group."""
    return repr(signal.getsignal(signal.SIGINT))


def any_kwargs_reward(response: str, data: dict[str, Any], **kwargs: Any) -> float:
    return float(len(kwargs))


def needs_target(response: str, data: dict[str, Any], *, target: int) -> float:
    return float(len(response) == target)
