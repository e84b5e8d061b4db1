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
without "reward", or a batched function's list of the wrong length), error (the function raised), timeout,
memory (the worker hit its memory cap), crashed, no_reward (every function returned None for the sample).

The reward function is named by import path ('package.module:function') because it must be importable
in another process; a callable is accepted only if it is reachable by such a path, and a built-in's registered
name (functions.REWARDS: "math", ...) is replaced by its function's path here, in the parent. The path is imported
once in the parent at construction, and its keyword arguments are checked against its signature, so a
typo fails at start-up rather than as a stream of zero rewards. Batched functions are also tried once in a
worker on a few dataset rows (`start(rows)`, relayrl/judge/trial.py): one that returns the wrong number of
values fails `wait_ready`, before the first rollout.
"""

from __future__ import annotations

import asyncio
import logging
import math
import pickle
import sys
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from relayrl.common.imports import import_from_path, module_level_path
from relayrl.common.registry import is_import_path
from relayrl.judge.batch import BatchScorer, Coalescer, Request
from relayrl.judge.functions import (
    REWARDS,
    ROW,
    RewardRejected,
    batched_kwargs_problem,
    describe,
    is_number,
    reward_kwargs_problem,
    reward_problem,
    weights_problem,
)
from relayrl.judge.pool import RemoteError, TimeoutPool, WorkerCrashed
from relayrl.judge.trial import trial, trial_rows
from relayrl.sample import Sample

logger = logging.getLogger(__name__)

DEFAULT_REWARD = "relayrl.judge.math:math_reward"
_MAX_REASON = 300  # characters of sample.error: enough to diagnose, short enough to log per sample
REJECTED_PREFIX = "judge_rejected_"  # + reason: the metric key a rejected judgement carries
RewardSpec = str | Callable[..., Any]  # an import path or an importable function
Judgement = tuple[float, dict[str, float], str | None]  # reward, metrics, error (None: not rejected)


class Judge:
    """Scores samples with `reward_fn(sample.response_text, sample.data, **reward_kwargs)`.

    The function returns a finite number with |r| <= max_abs_reward (the reward) or a dict with such a
    "reward" and optionally other numeric metrics (non-numeric extras are dropped). `sample.reward` is set
    and `sample.metrics` gets the metrics plus "reward" and "judge_failed". `calls` and `failures` count
    judgements; `memory_mb` > 0 caps each worker's address space (a call over it is rejected as "memory").

    reward_fn may also be a list, and any function may be written TRL's way, `fn(prompts, completions,
    **columns) -> list[float | None]` (relayrl/judge/functions.py says how the two kinds are told apart and
    what a batched function receives). Then the reward is the weighted sum (`reward_weights`, default all
    1.0) of the values given, batched functions are called on up to `batch_size` samples at once, and each
    function's value is the metric "reward/<name>" (relayrl/judge/batch.py).
    """

    def __init__(self, reward_fn: RewardSpec | list[RewardSpec] = DEFAULT_REWARD,
                 reward_kwargs: dict[str, Any] | None = None, timeout: float = 10.0, workers: int = 2, *,
                 max_abs_reward: float | None = None, memory_mb: int = 0,
                 reward_weights: list[float] | None = None, batch_size: int = 32):
        specs = list(reward_fn) if isinstance(reward_fn, list | tuple) else [reward_fn]
        paths = [reward_fn_path(spec) for spec in specs]
        if not paths:
            raise ValueError("reward_fn: give at least one reward function")
        if (problem := weights_problem(len(paths), reward_weights)) is not None:
            raise ValueError(f"reward_weights {problem}")
        weights = reward_weights if reward_weights is not None else [1.0] * len(paths)
        self.functions = [describe(import_from_path(p), p, w) for p, w in zip(paths, weights, strict=True)]
        self.reward_path = ", ".join(paths)
        self.reward_kwargs = dict(reward_kwargs or {})
        self._check_functions()
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
        modules = [p.partition(":")[0] if ":" in p else p.rpartition(".")[0] for p in paths]
        modules += ["relayrl.judge.functions"] if any(f.style != ROW for f in self.functions) else []
        self.pool = TimeoutPool(workers, preload=tuple(dict.fromkeys(modules)), name="relayrl-judge",
                                memory_mb=memory_mb)
        self.calls = 0
        self.failures = 0
        self._trial: threading.Thread | None = None
        self._trial_error: BaseException | None = None
        # one (response, row) function without weights: scored per sample, as relayrl always has
        single = len(self.functions) == 1 and self.functions[0].style == ROW and reward_weights is None
        scorer = BatchScorer(self.functions, self.pool, self.reward_kwargs, self.timeout, max_abs_reward,
                             lambda failed: self._reason(failed.error, failed.f.label, failed.n))
        self.batches = None if single else Coalescer(self._score_batch(scorer), batch_size, workers)

    @classmethod
    def from_config(cls, j: Any) -> Judge:
        """The judge the `judge` section (relayrl.config.schema.JudgeConfig) describes. The section's type is not
        imported: the judge sits below the config layer."""
        return cls(j.reward_fn, j.kwargs, timeout=j.timeout, workers=j.workers, max_abs_reward=j.max_abs_reward,
                   memory_mb=j.memory_mb, reward_weights=j.reward_weights, batch_size=j.batch_size)

    def _check_functions(self) -> None:
        """judge.kwargs against every function's signature, and distinct names (each is a metric): mistakes
        fail at construction, not as a stream of rejected samples."""
        for f in self.functions:
            fn = import_from_path(f.path)
            problem = (reward_kwargs_problem(fn, self.reward_kwargs) if f.style == ROW
                       else batched_kwargs_problem(f, fn, self.reward_kwargs))
            if problem is not None:
                raise TypeError(f"reward_kwargs[{problem[0]!r}]: {problem[1]}" if problem[0] else problem[1])
        names = [f.name for f in self.functions]
        if len(set(names)) < len(names):
            twice = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"two reward functions are named {twice!r}: each is logged as reward/<name>, rename one")

    async def judge(self, sample: Sample) -> Sample:
        """Set `sample.reward` and merge metrics; on any failure reward 0.0 and `sample.error` says why."""
        reward, metrics, error = await self.score(sample.response_text, sample.data, sample.uid, sample.response_ids)
        sample.reward = reward
        sample.metrics.update(metrics)
        if error is not None:
            sample.error = error
        return sample

    async def score(self, text: str, data: dict[str, Any], uid: str = "?",
                    completion_ids: list[int] | None = None) -> tuple[float, dict[str, float], str | None]:
        """Score any text against a row (agents judge single turns with this): (reward, metrics, error).

        metrics always holds "reward" and "judge_failed"; on failure the reward is 0.0, error says why and
        metrics also holds "judge_rejected_<reason>" (see the module docstring): the sample is not trained on.
        With several or batched functions, concurrent calls are scored together (relayrl/judge/batch.py) and
        metrics also hold each function's value as "reward/<name>". completion_ids: the text's token ids, for
        batched functions that take them.
        """
        self.calls += 1
        if self.batches is not None:
            return await self.batches.submit(Request(text, data, uid, completion_ids))
        try:
            out = await self.pool.call(self.reward_path, (text, data), self.reward_kwargs, timeout=self.timeout)
            reward, metrics = _reward_and_metrics(out, self.max_abs_reward)
        except Exception as e:  # CancelledError is a BaseException and propagates, as it should
            reason, text = self._reason(e, self.reward_path)
            failed = {"reward": 0.0, "judge_failed": 1.0, REJECTED_PREFIX + reason: 1.0}
            return 0.0, failed, self._fail(uid, text)
        return reward, {**metrics, "reward": reward, "judge_failed": 0.0}, None

    def start(self, rows: Sequence[dict[str, Any]] | None = None) -> None:
        """Start the workers now (they import the reward module) so the first batch does not wait. With dataset
        `rows`, also begin the start-up trial of the batched functions (relayrl/judge/trial.py) in a thread, so
        it overlaps whatever the caller does next (loading the model); `wait_ready` gives its verdict."""
        self.pool.start()
        if rows and any(f.style != ROW for f in self.functions) and self._trial is None:
            self._trial = threading.Thread(target=self._run_trial, args=(trial_rows(rows),), daemon=True,
                                           name="relayrl-judge-trial")
            self._trial.start()

    def _run_trial(self, rows: list[dict[str, Any]]) -> None:
        try:
            asyncio.run(trial(self.functions, self.pool, rows, self.reward_kwargs, self.timeout,
                              self.max_abs_reward))
        except BaseException as e:  # handed to wait_ready, in the caller's thread
            self._trial_error = e

    def wait_ready(self) -> None:
        """Block until the workers have imported the reward module and the start-up trial is over; a broken
        module, or a batched function that returns the wrong number of values (InputError), fails here."""
        if self._trial is not None:
            self._trial.join()
            self._trial = None
        if self._trial_error is not None:
            error, self._trial_error = self._trial_error, None
            raise error
        try:
            self.pool.wait_ready()
        except WorkerCrashed as e:
            if self.pool.memory_mb and "MemoryError" in str(e):
                raise WorkerCrashed(f"{e}\n(the reward module needs more than judge.memory_mb="
                                    f"{self.pool.memory_mb} MiB of address space to load: raise it, or 0: no limit)"
                                    ) from None
            raise

    def close(self) -> None:
        self.pool.close()  # first: a trial still running sees its worker die and ends
        if self._trial is not None:
            self._trial.join(timeout=5.0)

    def __enter__(self) -> Judge:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Judge:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def _score_batch(self, scorer: BatchScorer) -> Callable[[list[Request]], Awaitable[list[Judgement]]]:
        """The Coalescer's batch function: score, then turn each failure into a rejected judgement (one log line
        per distinct failure of the batch, not one per sample)."""
        async def run(batch: list[Request]) -> list[Judgement]:
            out: list[Judgement] = []
            failed: dict[str, list[str]] = {}
            for r, (reward, metrics, failure) in zip(batch, await scorer.score(batch), strict=True):
                if failure is None:
                    out.append((reward or 0.0, {**metrics, "reward": reward or 0.0, "judge_failed": 0.0}, None))
                    continue
                reason, text = failure
                out.append((0.0, {"reward": 0.0, "judge_failed": 1.0, REJECTED_PREFIX + reason: 1.0}, text))
                failed.setdefault(text, []).append(r.uid)
            for text, uids in failed.items():
                self._fail(uids[0], text, len(uids))
            return out

        return run

    def _fail(self, uid: str, reason: str, n: int = 1) -> str:
        before = self.failures
        self.failures += n
        if before < 5 or self.failures // 100 > before // 100:  # visible, but not one line per sample forever
            who = f"sample {uid}" if n == 1 else f"{n} samples, e.g. {uid}"
            logger.warning("judge failure %d of %d calls (%s): %s", self.failures, self.calls, who, reason)
        return reason

    def _reason(self, e: Exception, label: str, n: int = 1) -> tuple[str, str]:
        """(reason code, one-line text) of a failed judgement; label names the function, n the samples it cost."""
        batch = f" on a batch of {n} samples" if n > 1 else ""
        if isinstance(e, RewardRejected):
            reason, text = e.reason, f"reward {label} {e}"
        elif isinstance(e, TimeoutError):
            reason, text = "timeout", f"reward {label} timed out after {self.timeout:g}s{batch}"
        elif isinstance(e, RemoteError) and (e.exc_type == "MemoryError" or (
                self.pool.memory_mb and "out of memory" in e.message.lower())):  # CUDA's error under the cap
            reason = "memory"
            text = f"reward {label} ran out of memory{batch} (judge.memory_mb={self.pool.memory_mb})"
        elif isinstance(e, RemoteError):
            reason, text = "error", f"reward {label} raised {e.exc_type}{batch}: {e.message}"
        elif isinstance(e, WorkerCrashed):
            reason, text = "crashed", f"reward worker crashed running {label}{batch}: {e}"
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
                   if k != "reward" and is_number(v) and math.isfinite(float(v))}
    else:
        reward, metrics = out, {}
    reason = reward_problem(reward, bound)
    if reason is not None:
        raise RewardRejected(reason, f"returned a {reason.replace('_', '-')} reward: {reward!r:.80}")
    return float(reward), metrics


def reward_fn_path(fn: str | Callable[..., Any]) -> str:
    """The 'module:name' path a worker imports `fn` by, checked now so mistakes fail at construction. A registered
    name ("math") stands for its function, whose path the workers import."""
    if isinstance(fn, str) and not is_import_path(fn):
        fn = REWARDS.get(fn, "judge.reward_fn")
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
    path = f"{module}:{qualname}" if qualname else (module_level_path(fn) or f"{module}:?")
    module = path.partition(":")[0]
    try:
        reachable = bool(module) and "<" not in path and import_from_path(path) is fn
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
