"""`Judge`: give each finished sample a reward, in worker processes, without ever failing the caller.

Reward functions are user code run on model output: they raise, hang in sympy, return garbage or crash
the interpreter. None of that may stall or kill a rollout loop, so the function runs in a `TimeoutPool`
and every failure becomes reward 0.0 with `metrics["judge_failed"] = 1.0`, a one-line `sample.error`,
and a `failures` count the trainer can log. Cancelling `judge()` still propagates (that is the caller's
own decision, not a failure).

The reward function is named by import path ('package.module:function') because it must be importable
in another process; a callable is accepted only if it is reachable by such a path. The path is imported
once in the parent at construction, so a typo fails at start-up rather than as a stream of zero rewards.
"""

from __future__ import annotations

import logging
import math
import numbers
import pickle
import sys
from collections.abc import Callable
from typing import Any

from relayrl.judge.pool import RemoteError, TimeoutPool, WorkerCrashed
from relayrl.sample import Sample
from relayrl.utils import import_from_path

logger = logging.getLogger(__name__)

DEFAULT_REWARD = "relayrl.judge.math:math_reward"
_MAX_REASON = 300  # characters of sample.error: enough to diagnose, short enough to log per sample


class Judge:
    """Scores samples with `reward_fn(sample.response_text, sample.data, **reward_kwargs)`.

    The function returns a number (the reward) or a dict with a numeric "reward" and optionally other
    numeric metrics (non-numeric extras are dropped). `sample.reward` is set and `sample.metrics` gets
    the metrics plus "reward" and "judge_failed". `calls` and `failures` count judgements.
    """

    def __init__(self, reward_fn: str | Callable[..., Any] = DEFAULT_REWARD,
                 reward_kwargs: dict[str, Any] | None = None, timeout: float = 10.0, workers: int = 2):
        self.reward_path = reward_fn_path(reward_fn)
        self.reward_kwargs = dict(reward_kwargs or {})
        try:
            pickle.dumps(self.reward_kwargs)
        except Exception as e:
            raise TypeError(f"reward_kwargs must be picklable to reach the worker processes: {e}") from e
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.timeout = float(timeout)
        path = self.reward_path
        module = path.partition(":")[0] if ":" in path else path.rpartition(".")[0]
        self.pool = TimeoutPool(workers, preload=(module,), name="relayrl-judge")
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

        metrics always holds "reward" and "judge_failed"; on failure the reward is 0.0 and error says why.
        """
        self.calls += 1
        try:
            out = await self.pool.call(self.reward_path, (text, data), self.reward_kwargs, timeout=self.timeout)
            reward, metrics = _reward_and_metrics(out)
        except Exception as e:  # CancelledError is a BaseException and propagates, as it should
            return 0.0, {"reward": 0.0, "judge_failed": 1.0}, self._fail(uid, self._reason(e))
        return reward, {**metrics, "reward": reward, "judge_failed": 0.0}, None

    def start(self) -> None:
        """Start the workers now (they import the reward module) so the first batch does not wait."""
        self.pool.start()

    def wait_ready(self) -> None:
        """Block until the workers have imported the reward module; a broken module fails here."""
        self.pool.wait_ready()

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

    def _reason(self, e: Exception) -> str:
        if isinstance(e, TimeoutError):
            text = f"reward {self.reward_path} timed out after {self.timeout:g}s"
        elif isinstance(e, RemoteError):
            text = f"reward {self.reward_path} raised {e.exc_type}: {e.message}"
        elif isinstance(e, WorkerCrashed):
            text = f"reward worker crashed: {e}"
        else:
            text = f"{type(e).__name__}: {e}"
        text = "judge: " + " ".join(text.split())
        return text if len(text) <= _MAX_REASON else text[: _MAX_REASON - 3] + "..."


def _reward_and_metrics(out: Any) -> tuple[float, dict[str, float]]:
    """Validate what the reward function returned (see `Judge`); raises ValueError if unusable."""
    if isinstance(out, dict):
        if "reward" not in out:
            raise ValueError(f"reward_fn returned a dict without 'reward' (keys: {sorted(map(str, out))})")
        reward = out["reward"]
        metrics = {str(k): float(v) for k, v in out.items() if k != "reward" and _is_number(v)}
    else:
        reward, metrics = out, {}
    if not _is_number(reward) or not math.isfinite(float(reward)):
        raise ValueError(f"reward_fn returned a non-number reward: {reward!r:.80}")
    return float(reward), metrics


def _is_number(v: Any) -> bool:
    return isinstance(v, numbers.Real)


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
