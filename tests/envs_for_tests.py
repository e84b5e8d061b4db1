"""Environments that tests name by import path (`agent.kwargs.env=envs_for_tests:EchoEnv`): ones that behave,
one per way to misbehave, and classes that do not implement the protocol."""

from __future__ import annotations

import asyncio
import threading
from typing import Any


class EchoEnv:
    """Opens with its own messages; replies to every turn with a message that depends on the turn's text (so the
    test can recompute it), rewards turn k with k, never ends by itself."""

    def __init__(self, greeting: str = "You are a counter."):
        self.greeting, self.turn = greeting, 0

    def reset(self, row: dict[str, Any]) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.greeting}, {"role": "user", "content": row["question"]}]

    def step(self, assistant_text: str) -> tuple[list[dict[str, str]], float, bool]:
        self.turn += 1
        return self.reply(assistant_text), float(self.turn), False

    @staticmethod
    def reply(text: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"You wrote {len(text)} characters. Again."}]


class ParityEnv:
    """Keeps relayrl's prompt; a turn of even length is right (reward 1, done), else 0 and "Try again." Rows
    whose question holds BAD make `step` raise: that episode fails, the others go on."""

    def reset(self, row: dict[str, Any]) -> None:
        self.bad = "BAD" in row["question"]

    def step(self, assistant_text: str) -> tuple[list[dict[str, str]], float, bool]:
        if self.bad:
            raise RuntimeError("the environment broke")
        right = len(assistant_text) % 2 == 0
        return [] if right else [{"role": "user", "content": "Try again."}], float(right), right


class AsyncEnv:
    """`async def` reset and step; ends after its second turn with reward 0.5 per turn."""

    async def reset(self, row: dict[str, Any]) -> list[dict[str, str]]:
        await asyncio.sleep(0)
        self.turns = 0
        return [{"role": "user", "content": row["question"]}]

    async def step(self, assistant_text: str) -> tuple[list[dict[str, str]], float, bool]:
        await asyncio.sleep(0.01)
        self.turns += 1
        return [{"role": "user", "content": "More."}], 0.5, self.turns >= 2


class SilentEnv:
    """Plays the other side but scores nothing: the judge scores the episode."""

    def reset(self, row: dict[str, Any]) -> None:
        return None

    def step(self, assistant_text: str) -> tuple[list[dict[str, str]], None, bool]:
        return [{"role": "user", "content": "Go on."}], None, False


class HangingEnv:
    """`step` blocks far past any env_timeout (a daemon thread, abandoned by the agent)."""

    def reset(self, row: dict[str, Any]) -> None:
        return None

    def step(self, assistant_text: str) -> tuple[list, float, bool]:
        threading.Event().wait(60)
        return [], 0.0, True


class NoStepEnv:
    """Not an environment: no step."""

    def reset(self, row: dict[str, Any]) -> None:
        return None


class NoArgStepEnv:
    """Not an environment: step takes no assistant text."""

    def reset(self, row: dict[str, Any]) -> None:
        return None

    def step(self) -> tuple[list, float, bool]:
        return [], 0.0, True


class ClosingEnv(ParityEnv):
    """ParityEnv with the protocol's optional close(): records each call in `closed` (class-wide, the test reads
    it); with fail_close=True close raises."""

    closed: list[str] = []

    def __init__(self, fail_close: bool = False):
        self.fail_close = fail_close

    def reset(self, row: dict[str, Any]) -> None:
        super().reset(row)
        self.question = row["question"]

    def close(self) -> None:
        ClosingEnv.closed.append(self.question)
        if self.fail_close:
            raise OSError("the game server is gone")
