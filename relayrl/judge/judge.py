"""`Judge`: give each finished sample a reward, in worker processes, without ever failing the caller.

Reward functions are user code run on model output: they raise, hang in sympy, return garbage or crash
the interpreter. None of that may stall or kill a rollout loop, so the function runs in a `TimeoutPool`
and every failure becomes a *rejected* judgement: reward 0.0 with `metrics["judge_failed"] = 1.0`, a
`metrics["judge_rejected_<reason>"] = 1.0` naming why, a one-line `sample.error`, and a `failures` count.
The scheduler then marks the sample `Status.REJECTED`: it is counted (`judge/rejected_<reason>`), never
trained on. Why not train on the 0.0: a verifier that crashed on a right answer would teach the policy
away from it, and a NaN or 1e30 would poison a whole batch's advantages. Cancelling `judge()` still
propagates (that is the caller's own decision, not a failure).

Reasons: nonfinite (NaN, inf), out_of_range (|reward| > max_abs_reward), invalid (not a number, or a dict
without "reward"), error (the function raised), timeout, memory (the worker hit its memory cap), crashed.

The reward function is named by import path ('package.module:function') because it must be importable
in another process; a callable is accepted only if it is reachable by such a path. The path is imported
once in the parent at construction, and its keyword arguments are checked against its signature, so a
typo fails at start-up rather than as a stream of zero rewards.
"""

from __future__ import annotations

import inspect
import logging
import math
import numbers
import pickle
import sys
from collections.abc import Callable
from typing import Any

from relayrl.common.utils import import_from_path
from relayrl.judge.pool import RemoteError, TimeoutPool, WorkerCrashed
from relayrl.sample import Sample

logger = logging.getLogger(__name__)

DEFAULT_REWARD = "relayrl.judge.math:math_reward"
_MAX_REASON = 300  # characters of sample.error: enough to diagnose, short enough to log per sample
REJECTED_PREFIX = "judge_rejected_"  # + reason: the metric key a rejected judgement carries


class RewardRejected(ValueError):
    """The reward function answered, but with something that must not be trained on."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class Judge:
    """Scores samples with `reward_fn(sample.response_text, sample.data, **reward_kwargs)`.

    The function returns a finite number with |r| <= max_abs_reward (the reward) or a dict with such a
    "reward" and optionally other numeric metrics (non-numeric extras are dropped). `sample.reward` is set
    and `sample.metrics` gets the metrics plus "reward" and "judge_failed". `calls` and `failures` count
    judgements; `memory_mb` > 0 caps each worker's address space (a call over it is rejected as "memory").
    """

    def __init__(self, reward_fn: str | Callable[..., Any] = DEFAULT_REWARD,
                 reward_kwargs: dict[str, Any] | None = None, timeout: float = 10.0, workers: int = 2, *,
                 max_abs_reward: float | None = None, memory_mb: int = 0):
        self.reward_path = reward_fn_path(reward_fn)
        self.reward_kwargs = dict(reward_kwargs or {})
        problem = reward_kwargs_problem(import_from_path(self.reward_path), self.reward_kwargs)
        if problem is not None:
            raise TypeError(f"reward_kwargs[{problem[0]!r}]: {problem[1]}" if problem[0] else problem[1])
        if max_abs_reward is not None and not max_abs_reward > 0:
            raise ValueError(f"max_abs_reward must be > 0 (or None: no bound), got {max_abs_reward}")
        self.max_abs_reward = max_abs_reward
        try:
            pickle.dumps(self.reward_kwargs)
        except Exception as e:
            raise TypeError(f"reward_kwargs must be picklable to reach the worker processes: {e}") from e
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.timeout = float(timeout)
        path = self.reward_path
        module = path.partition(":")[0] if ":" in path else path.rpartition(".")[0]
        self.pool = TimeoutPool(workers, preload=(module,), name="relayrl-judge", memory_mb=memory_mb)
        self.calls = 0
        self.failures = 0

    async def judge(self, sample: Sample) -> Sample:
        """Set `sample.reward` and merge metrics; on any failure reward 0.0 and `sample.error` says why."""
        reward, metrics, error = await self.score(sample.response_text, sample.data, sample.uid)
        sample.reward = reward
        sample.metrics.update(metrics)
        if error is not None:
            sample.error = error
        return sample

    async def score(self, text: str, data: dict[str, Any],
                    uid: str = "?") -> tuple[float, dict[str, float], str | None]:
        """Score any text against a row (agents judge single turns with this): (reward, metrics, error).

        metrics always holds "reward" and "judge_failed"; on failure the reward is 0.0, error says why and
        metrics also holds "judge_rejected_<reason>" (see the module docstring): the sample is not trained on.
        """
        self.calls += 1
        try:
            out = await self.pool.call(self.reward_path, (text, data), self.reward_kwargs, timeout=self.timeout)
            reward, metrics = _reward_and_metrics(out, self.max_abs_reward)
        except Exception as e:  # CancelledError is a BaseException and propagates, as it should
            reason, text = self._reason(e)
            failed = {"reward": 0.0, "judge_failed": 1.0, REJECTED_PREFIX + reason: 1.0}
            return 0.0, failed, self._fail(uid, text)
        return reward, {**metrics, "reward": reward, "judge_failed": 0.0}, None

    def start(self) -> None:
        """Start the workers now (they import the reward module) so the first batch does not wait."""
        self.pool.start()

    def wait_ready(self) -> None:
        """Block until the workers have imported the reward module; a broken module fails here."""
        try:
            self.pool.wait_ready()
        except WorkerCrashed as e:
            if self.pool.memory_mb and "MemoryError" in str(e):
                raise WorkerCrashed(f"{e}\n(the reward module needs more than judge.memory_mb="
                                    f"{self.pool.memory_mb} MiB of address space to load: raise it, or 0: no limit)"
                                    ) from None
            raise

    def close(self) -> None:
        self.pool.close()

    def __enter__(self) -> Judge:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Judge:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def _fail(self, uid: str, reason: str) -> str:
        self.failures += 1
        if self.failures <= 5 or self.failures % 100 == 0:  # visible, but not one line per sample forever
            logger.warning("judge failure %d of %d calls (sample %s): %s", self.failures, self.calls, uid, reason)
        return reason

    def _reason(self, e: Exception) -> tuple[str, str]:
        """(reason code, one-line text) of a failed judgement."""
        if isinstance(e, RewardRejected):
            reason, text = e.reason, f"reward {self.reward_path} {e}"
        elif isinstance(e, TimeoutError):
            reason, text = "timeout", f"reward {self.reward_path} timed out after {self.timeout:g}s"
        elif isinstance(e, RemoteError) and (e.exc_type == "MemoryError" or (
                self.pool.memory_mb and "out of memory" in e.message.lower())):  # CUDA's error under the cap
            reason = "memory"
            text = f"reward {self.reward_path} ran out of memory (judge.memory_mb={self.pool.memory_mb})"
        elif isinstance(e, RemoteError):
            reason, text = "error", f"reward {self.reward_path} raised {e.exc_type}: {e.message}"
        elif isinstance(e, WorkerCrashed):
            reason, text = "crashed", f"reward worker crashed: {e}"
        else:
            reason, text = "error", f"{type(e).__name__}: {e}"
        text = "judge: " + " ".join(text.split())
        return reason, text if len(text) <= _MAX_REASON else text[: _MAX_REASON - 3] + "..."


def _reward_and_metrics(out: Any, bound: float | None = None) -> tuple[float, dict[str, float]]:
    """Validate what the reward function returned (see `Judge`); raises RewardRejected if unusable."""
    if isinstance(out, dict):
        if "reward" not in out:
            raise RewardRejected("invalid", f"returned a dict without 'reward' (keys: {sorted(map(str, out))})")
        reward = out["reward"]
        metrics = {str(k): float(v) for k, v in out.items()
                   if k != "reward" and _is_number(v) and math.isfinite(float(v))}
    else:
        reward, metrics = out, {}
    reason = reward_problem(reward, bound)
    if reason is not None:
        raise RewardRejected(reason, f"returned a {reason.replace('_', '-')} reward: {reward!r:.80}")
    return float(reward), metrics


def reward_problem(reward: Any, bound: float | None = None) -> str | None:
    """Why `reward` must not be trained on ("invalid", "nonfinite", "out_of_range"), or None if it is fine.

    Used on the judge's answers and again on every finished sample, whoever set its rewards (an agent or an
    episode function may set them without the judge).
    """
    if not _is_number(reward):
        return "invalid"
    if not math.isfinite(float(reward)):
        return "nonfinite"
    if bound is not None and abs(float(reward)) > bound:
        return "out_of_range"
    return None


def _is_number(v: Any) -> bool:
    return isinstance(v, numbers.Real)


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


def reward_fn_path(fn: str | Callable[..., Any]) -> str:
    """The 'module:name' path a worker imports `fn` by, checked now so mistakes fail at construction."""
    if isinstance(fn, str):
        try:
            obj = import_from_path(fn)
        except Exception as e:
            raise ImportError(f"Judge reward_fn {fn!r} cannot be imported: {e}") from e
        if not callable(obj):
            raise TypeError(f"Judge reward_fn {fn!r} names a {type(obj).__name__}, not a function")
        return fn
    if not callable(fn):
        raise TypeError(f"Judge reward_fn must be an import path or a function, got {type(fn).__name__}")
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    path = f"{module}:{qualname}"
    try:
        reachable = bool(module and qualname) and "<" not in qualname and import_from_path(path) is fn
    except Exception:
        reachable = False
    if module == "__main__" and not getattr(sys.modules["__main__"], "__file__", None):
        reachable = False  # an interactive __main__ cannot be re-imported by a worker
    if not reachable:
        raise ValueError(
            f"Judge reward_fn {fn!r} cannot run in a worker process: it is not importable by path "
            f"(lambdas, local functions, partials and bound methods are not). Define it at module level "
            f"and pass 'package.module:function'; put its arguments in reward_kwargs."
        )
    return path
