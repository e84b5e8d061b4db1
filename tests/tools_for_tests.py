"""User tool functions for the tests (tests/integration/test_user_tools.py), named by import path as a user's
config names them: typed and documented ones, an async one, ones that hang or raise, and ones the agent must
refuse (no type hints, no docstring)."""

import asyncio
import time

CAPITALS = {"France": "Paris", "Japan": "Tokyo", "Kenya": "Nairobi"}


def capital_of(country: str, style: str = "plain") -> str:
    """Look up the capital city of a country.

    Args:
        country: The country's English name, e.g. France.
        style: How to write the answer. (choices: ["plain", "shout"])

    Returns:
        The capital's name, or "unknown".
    """
    name = CAPITALS.get(country, "unknown")
    return name.upper() if style == "shout" else name


async def add_all(numbers: list[float], offset: int | None = None) -> dict:
    """Add numbers, awaiting like a tool that calls a service.

    Args:
        numbers: The numbers to add.
        offset: Added to the sum when given.
    """
    await asyncio.sleep(0.01)
    return {"sum": sum(numbers) + (offset or 0)}


def hang(seconds: float) -> str:
    """Block for a long time, as a tool stuck on a dead connection does.

    Args:
        seconds: How long to block.
    """
    time.sleep(seconds)
    return "done"


async def hang_async(seconds: float) -> str:
    """Await for a long time.

    Args:
        seconds: How long to wait.
    """
    await asyncio.sleep(seconds)
    return "done"


def explode(reason: str) -> str:
    """Always raise.

    Args:
        reason: The error's message.
    """
    raise ValueError(reason)


def no_hints(country, style: str = "plain") -> str:
    """Look up a capital.

    Args:
        country: The country.
        style: How to write it.
    """
    return CAPITALS.get(country, "unknown")


def no_doc(country: str) -> str:
    return CAPITALS.get(country, "unknown")
