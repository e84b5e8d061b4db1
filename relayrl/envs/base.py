"""The environment protocol: `reset(row)` and `step(assistant_text)`, the only two calls an agent makes.

An environment is a class; the generic `EnvAgent` (relayrl/agents/env.py) makes one instance per episode with
`agent.kwargs.env_kwargs`, so an instance may keep the episode's state in plain attributes. Its two methods may
be plain or `async def`:

- `reset(row) -> messages | None`: the chat messages that start the episode (system and user turns), or None to
  start from the prompt relayrl built from the row (`data.prompt.system` and `suffix` applied);
- `step(assistant_text) -> (messages, reward, done)`: the environment's answer to one assistant turn: the
  messages that follow it (user feedback, tool results), this turn's reward (a float, or None for none), and
  whether the episode is over (the messages of a final step are not shown to the model: it speaks no more);
- `close()` (optional): called after every episode, played out or failed, to free what it held (a game, a
  process, a connection); bounded by the same timeout. Its failure is logged and counted, the episode stands.

The agent holds the token ids; the environment sees and writes only text. Plain methods run in a thread of their
own (they may block); every call is bounded by `agent.kwargs.env_timeout`. What an environment raises, a call
that outlives its timeout, or a malformed return is an `EnvError`: it costs that episode, never the run.

This module depends on nothing above relayrl.common: agents import environments, not the other way round.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple, Protocol

from relayrl.common.errors import InputError
from relayrl.common.imports import import_from_path
from relayrl.common.threads import in_thread

Message = dict[str, Any]  # {"role": ..., "content": str, ...}: what a chat template takes


class Step(NamedTuple):
    """What `step` returns (any 3-tuple in this order does)."""

    messages: list[Message]
    reward: float | None
    done: bool


class Environment(Protocol):
    """What an environment class implements; subclassing is not needed (checked by `check_env_class`)."""

    def reset(self, row: dict[str, Any]) -> list[Message] | None | Awaitable[list[Message] | None]:
        """Start an episode on a dataset row: its first messages, or None for relayrl's prompt of the row."""

    def step(self, assistant_text: str) -> Step | Awaitable[Step]:
        """Answer one assistant turn: (messages that follow it, this turn's reward or None, done)."""


def has_close(cls: type) -> bool:
    """Whether the environment class implements the protocol's optional `close()` (checked once per class)."""
    close = getattr(cls, "close", None)  # a protocol check of the user's class, as check_env_class does
    if close is not None and not callable(close):
        raise InputError(f"{where(cls)}.close is not a method; the environment protocol's close() takes no argument")
    return close is not None


class EnvError(Exception):
    """An environment call raised, hung or returned something malformed: the episode fails, the run goes on."""


def where(cls: type) -> str:
    """'module:Class (file)': the class and file to name in an error."""
    try:
        path = inspect.getsourcefile(cls) or "?"
    except TypeError:  # a class without a source file (built-in, made by exec)
        path = "?"
    return f"{cls.__module__}:{cls.__qualname__} ({path})"


def resolve_env(spec: str | type, env_kwargs: dict[str, Any], key: str = "agent.kwargs.env") -> type:
    """The environment class `spec` names (an import path or the class), checked against the protocol and
    `env_kwargs` before any model loads. An InputError names the key, the class and its file."""
    if isinstance(spec, str):
        try:
            spec = import_from_path(spec)
        except (ImportError, ValueError) as e:
            raise InputError(f"{key}: {e}") from None
    if not isinstance(spec, type):
        raise InputError(f"{key}: {spec!r} is a {type(spec).__name__}, not a class; name the environment class "
                         "('package.module:MyEnv'): an instance is made per episode")
    check_env_class(spec, env_kwargs, key)
    return spec


def check_env_class(cls: type, env_kwargs: dict[str, Any], key: str = "agent.kwargs.env") -> None:
    """`cls` has reset(row) and step(assistant_text) methods, and its constructor takes `env_kwargs`."""
    for name, arg in (("reset", "row"), ("step", "assistant_text")):
        method = getattr(cls, name, None)  # a protocol check of the user's class, not a feature probe
        if not callable(method):
            raise InputError(f"{key}: {where(cls)} does not implement the environment protocol: it has no "
                             f"{name}({arg}) method (relayrl/envs/base.py, Environment)")
        try:
            inspect.signature(method).bind(None, arg)  # self and one argument
        except TypeError as e:
            raise InputError(f"{key}: {where(cls)}.{name} must take one argument ({arg}) besides self: "
                             f"{name}{inspect.signature(method)} ({e})") from None
    try:
        inspect.signature(cls).bind(**env_kwargs)
    except TypeError as e:
        raise InputError(f"agent.kwargs.env_kwargs do not fit {where(cls)}{inspect.signature(cls)}: {e}") from None


async def call_env(fn: Callable[..., Any], args: tuple, timeout: float | None, what: str) -> Any:
    """`fn(*args)` bounded by `timeout`: an async method on the loop, a plain one in a daemon thread (a hung one
    is abandoned); anything it raises, and the timeout, become an EnvError naming `what`."""
    async def invoke() -> Any:
        if inspect.iscoroutinefunction(inspect.unwrap(fn)):
            return await fn(*args)
        out = await in_thread(functools.partial(fn, *args), {}, kind="env")
        return await out if inspect.isawaitable(out) else out

    try:
        return await asyncio.wait_for(invoke(), timeout)
    except asyncio.CancelledError:
        raise
    except TimeoutError:
        raise EnvError(f"{what} did not return within {timeout:g} s (agent.kwargs.env_timeout)") from None
    except Exception as e:
        raise EnvError(f"{what} raised {type(e).__name__}: {e}") from e


def as_messages(value: Any, what: str) -> list[Message]:
    """`value` as chat messages (None: none), or an EnvError saying what is wrong with it."""
    if value is None:
        return []
    if not isinstance(value, list | tuple):
        raise EnvError(f"{what} returned {type(value).__name__}, not a list of messages")
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise EnvError(f"{what} returned a bad message {i}: {m!r:.200} (each must be a dict with string 'role' "
                           "and 'content')")
    return [dict(m) for m in value]


def as_step(value: Any, what: str) -> Step:
    """`value` as a Step (messages, reward, done), or an EnvError. A NaN or out-of-range reward passes: the
    scheduler rejects the sample as it rejects a judge's (counted in judge/rejected_<reason>)."""
    if not (isinstance(value, tuple | list) and len(value) == 3):
        raise EnvError(f"{what} returned {value!r:.200}, not (messages, reward, done)")
    messages, reward, done = value
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, int | float)):
        raise EnvError(f"{what} returned reward {reward!r:.80}, not a number or None")
    return Step(as_messages(messages, what), None if reward is None else float(reward), bool(done))
