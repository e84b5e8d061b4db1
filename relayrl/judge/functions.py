"""Reward functions as users write them: relayrl's per-sample `(response, row)` and TRL's batched
`(prompts, completions, **columns)`, one or several with weights.

Which kind a function is comes from its signature, read once in the parent (no probe call: user code runs only
in workers; relayrl/judge/trial.py tries batched ones there before the first rollout): it is **batched** (TRL's
GRPOTrainer convention) if a parameter is named `prompts`, `completions` or `completion_ids`, or if it takes
nothing but `**kwargs`; otherwise it is a **row** function, called once per sample as
`fn(response, row, **judge.kwargs)`, as relayrl always has.

A batched function gets keyword lists, one entry per sample, as TRL passes them: `prompts` (the row's prompt
as the dataset wrote it: text, or a list of chat messages), `completions` (the response text, or for conversational
prompts `[{"role": "assistant", "content": text}]`), `completion_ids` (token ids; None where an agent scored a
text without them), every other row field (all but `prompt`, `completion`, `completion_ids`) as a list, and
`judge.kwargs` as plain values. A function without `**kwargs` gets only the fields it names (TRL would raise
on the others). It returns one value per sample: a number, or None for "no reward from this function here".
`async def` functions are awaited in the worker. Unlike TRL, NaN and inf are not read as None: they reject the
sample (relayrl's rule: a verifier that returns NaN is broken, not silent).

Why the signature and not a config flag: a TRL user's function works unchanged, and the existing
`(response, row)` functions keep working without a new key. Model-based rewards (an LLM judge behind an
OpenAI endpoint, an HF sequence-classification model) are batched functions like any other: an `async def`
that calls the endpoint, or a function whose module loads the model once per worker (judge.memory_mb=0 for CUDA).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from relayrl.common.errors import InputError
from relayrl.common.imports import import_from_path
from relayrl.common.registry import Registry

ROW, BATCHED = "row", "batched"
# built-in rewards judge.reward_fn may name instead of an import path (each module registers its own); workers
# import a function by path, so a name is resolved to its function's path in the parent (judge.reward_fn_path)
REWARDS: Registry[Callable[..., Any]] = Registry("reward function")
TRL_ARGS = ("prompts", "completions", "completion_ids")  # what TRL passes besides the columns
NOT_COLUMNS = ("prompt", "completion", "completion_ids")  # row fields TRL does not pass as columns


class RewardRejected(ValueError):
    """The reward function answered, but with something that must not be trained on."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def reward_problem(reward: Any, bound: float | None = None) -> str | None:
    """Why `reward` must not be trained on ("invalid", "nonfinite", "out_of_range"), or None if it is fine.

    Used on the judge's answers and again on every finished sample, whoever set its rewards (an agent or an
    episode function may set them without the judge).
    """
    if not is_number(reward):
        return "invalid"
    if not math.isfinite(float(reward)):
        return "nonfinite"
    if bound is not None and abs(float(reward)) > bound:
        return "out_of_range"
    return None


def is_number(v: Any) -> bool:
    return isinstance(v, numbers.Real)


@dataclass(frozen=True)
class RewardFunction:
    """One configured reward function: where workers import it from, and how to call it."""

    path: str  # 'module:qualname', imported by the workers
    name: str  # __name__: the metric reward/<name>
    file: str  # its source file, for error messages
    line: int | None  # where it is defined in that file (None for a callable object)
    weight: float
    style: str  # ROW or BATCHED
    params: frozenset[str]  # the names it takes by keyword
    any_kwargs: bool  # it takes **kwargs: every column goes to it

    @property
    def label(self) -> str:
        return f"{self.name} ({self.file})"

    @property
    def where(self) -> str:
        """file:line, for the start-up errors that point at the definition."""
        return self.file if self.line is None else f"{self.file}:{self.line}"

    def takes(self, name: str) -> bool:
        return self.any_kwargs or name in self.params


def style_of(fn: Callable[..., Any]) -> str:
    """BATCHED if fn names a TRL argument or takes only **kwargs, else ROW (see the module docstring)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no signature to read (a builtin): relayrl's own convention
        return ROW
    if any(p.name in TRL_ARGS for p in params):
        return BATCHED
    return BATCHED if params and all(p.kind is p.VAR_KEYWORD for p in params) else ROW


def describe(fn: Callable[..., Any], path: str, weight: float = 1.0) -> RewardFunction:
    """The RewardFunction for an imported `fn` named by `path`."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    try:
        file = inspect.getsourcefile(fn) or inspect.getfile(fn)
    except TypeError:
        file = path.partition(":")[0]
    named = frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    code = getattr(inspect.unwrap(fn), "__code__", None)
    return RewardFunction(path=path, name=getattr(fn, "__name__", path.rpartition(":")[2]), file=file,
                          line=code.co_firstlineno if code is not None else None,
                          weight=float(weight), style=style_of(fn), params=named,
                          any_kwargs=any(p.kind is p.VAR_KEYWORD for p in params))


def weights_problem(n_functions: int, weights: Sequence[float] | None) -> str | None:
    """Why `weights` cannot go with n_functions reward functions, or None."""
    if weights is None:
        return None
    if len(weights) != n_functions:
        return f"has {len(weights)} weights for {n_functions} reward function(s): give one weight per function"
    bad = next((w for w in weights if not is_number(w) or not math.isfinite(float(w))), None)
    return None if bad is None else f"must be finite numbers, got {bad!r}"


def batched_kwargs_problem(f: RewardFunction, fn: Callable[..., Any], kwargs: dict[str, Any],
                           columns: Iterable[str] | None = None) -> tuple[str, str] | None:
    """(name, why) for a judge.kwargs key a batched function cannot take, or ("", why) for a required argument
    that neither TRL's arguments, judge.kwargs nor the rows' fields (`columns`, when known) supply; None if fine.
    Checked in the parent at start-up: the same mistake would otherwise reject every batch of the run."""
    for name in kwargs:
        if not f.takes(name):
            return name, f"unknown argument for reward function {f.label}; it takes {', '.join(sorted(f.params))}"
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    known = set(TRL_ARGS) | set(kwargs) | (set(columns) - set(NOT_COLUMNS) if columns is not None else set())
    for p in params:
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in known:
            if columns is None:
                continue  # a column, perhaps: checked again once the rows are known
            return "", (f"reward function {f.label} requires argument {p.name!r}, which is neither a TRL argument "
                        f"({', '.join(TRL_ARGS)}), a field of the rows, nor in judge.kwargs")
    return None


def reward_kwargs_problem(fn: Callable[..., Any], kwargs: dict[str, Any]) -> tuple[str, str] | None:
    """(name, why) for the first keyword argument `fn(response, data, **kwargs)` would not accept, or for a
    required argument kwargs leaves out (name "" when fn cannot take (response, data) at all); None if the
    call fits. Unknown names pass when fn takes **kwargs. Checked in the parent at start-up: the same
    mistake in a worker would cost every sample of the run."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # builtins without a signature: nothing to check against
        return None
    label = getattr(fn, "__qualname__", repr(fn))
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 2 and not any(p.kind is p.VAR_POSITIONAL for p in params):
        return "", f"reward function {label} must take (response, data) as its first two arguments"
    taken = {p.name for p in positional[:2]}  # response and data are passed by position
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - taken
    for name in kwargs if not any(p.kind is p.VAR_KEYWORD for p in params) else ():
        if name not in named:
            hint = f"its keyword arguments are {', '.join(sorted(named))}" if named else "it takes no keyword arguments"
            return name, f"unknown argument for reward function {label}; {hint}"
    for p in params:
        if p.name not in taken and p.name not in kwargs and p.default is p.empty and p.kind not in (
                p.VAR_POSITIONAL, p.VAR_KEYWORD):
            return p.name, f"reward function {label} requires argument {p.name!r}: set it in judge.kwargs"
    return None


def reward_function(spec: str, key: str = "judge.reward_fn") -> Callable[..., Any]:
    """The function `spec` names: a registered name (REWARDS) or an import path; an InputError naming `key` when
    it names nothing, or something that is not callable."""
    fn = REWARDS.get(spec, key)
    if not callable(fn):
        raise InputError(f"{key}: {spec!r} is a {type(fn).__name__}, not a function")
    return fn


def arguments_problem(fn: Callable[..., Any], path: str, kwargs: dict[str, Any],
                      columns: Iterable[str] | None = None) -> tuple[str, str] | None:
    """(name, why) for the first argument problem of reward `fn` with judge.kwargs (and, for a batched function,
    the rows' fields when known): `reward_kwargs_problem` or `batched_kwargs_problem`, by its kind."""
    if style_of(fn) == ROW:
        return reward_kwargs_problem(fn, kwargs)
    return batched_kwargs_problem(describe(fn, path), fn, kwargs, columns)


def is_conversational(prompt: Any) -> bool:
    """TRL's test: the prompt is a list of {"role", "content"} messages."""
    return isinstance(prompt, list) and bool(prompt) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in prompt)


def prompt_of(row: dict[str, Any]) -> Any:
    """The prompt TRL would pass for a loaded row: its chat messages (relayrl.data.formats keeps a message-list
    prompt, without a final assistant turn, in "prompt_messages"), else its `prompt` text, else `question`."""
    for key in ("prompt_messages", "prompt", "question"):
        if row.get(key) is not None:
            return row[key]
    return None


def batch_arguments(f: RewardFunction, texts: list[str], rows: list[dict[str, Any]],
                    ids: list[list[int] | None], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of one call of batched `f` (see the module docstring)."""
    prompts = [prompt_of(row) for row in rows]
    completions: list[Any] = [[{"role": "assistant", "content": t}] if is_conversational(p) else t
                              for p, t in zip(prompts, texts, strict=True)]
    out: dict[str, Any] = {"prompts": prompts, "completions": completions, "completion_ids": ids}
    fields = dict.fromkeys(k for row in rows for k in row if k not in NOT_COLUMNS)
    out |= {k: [row.get(k) for row in rows] for k in fields}
    out |= kwargs
    return out if f.any_kwargs else {k: v for k, v in out.items() if k in f.params}


def batch_values(out: Any, n: int, bound: float | None) -> list[float | None]:
    """Check what a batched function returned for n samples: n numbers or Nones (else RewardRejected)."""
    if not isinstance(out, list):
        raise RewardRejected("invalid", f"returned a {type(out).__name__}, expected a list of {n} values "
                                        f"(one per completion)")
    if len(out) != n:
        raise RewardRejected("invalid", f"returned {len(out)} values for {n} completions (expected {n}: a batched "
                                        f"reward function returns one value, or None, per completion)")
    for v in out:
        reason = None if v is None else reward_problem(v, bound)
        if reason is not None:
            raise RewardRejected(reason, f"returned a {reason.replace('_', '-')} reward: {v!r:.80}")
    return [None if v is None else float(v) for v in out]


def row_value(out: Any, bound: float | None) -> tuple[float | None, dict[str, float]]:
    """Check what a row function returned for one sample: a number, None, or a dict with "reward" (and other
    numeric metrics, kept); else RewardRejected."""
    metrics: dict[str, float] = {}
    if isinstance(out, dict):
        if "reward" not in out:
            raise RewardRejected("invalid", f"returned a dict without 'reward' (keys: {sorted(map(str, out))})")
        metrics = {str(k): float(v) for k, v in out.items()
                   if k != "reward" and is_number(v) and math.isfinite(float(v))}
        out = out["reward"]
    reason = None if out is None else reward_problem(out, bound)
    if reason is not None:
        raise RewardRejected(reason, f"returned a {reason.replace('_', '-')} reward: {out!r:.80}")
    return (None if out is None else float(out)), metrics


# ---- the worker side ----------------------------------------------------------------------------------
_resolved: dict[str, Callable[..., Any]] = {}


def call_batched(path: str, kwargs: dict[str, Any]) -> Any:
    """Run batched reward `path` in a worker: await it if it is async, and turn numpy/torch scalars into
    floats so the parent needs neither library. Anything else comes back as it is, for the parent to judge."""
    if path not in _resolved:
        _resolved[path] = import_from_path(path)
    out = _resolved[path](**kwargs)
    if inspect.isawaitable(out):
        out = asyncio.run(_wait(out))
    if isinstance(out, str | bytes | dict) or not isinstance(out, Iterable):
        return out
    return [_plain(v) for v in out]


async def _wait(awaitable: Any) -> Any:
    return await awaitable


def _plain(v: Any) -> Any:
    if v is None or isinstance(v, str | bytes):
        return v
    try:
        return float(v)  # numbers, numpy scalars, 0-d arrays and tensors
    except (TypeError, ValueError):
        return v
