"""Scoring samples in batches: `Coalescer` gathers concurrent judge calls, `score_batch` runs every reward
function on a batch and combines their values into one reward per sample.

Where the batches come from: agents judge one sample at a time, as each trajectory finishes (a multi-turn agent
may judge several texts per trajectory), and the samples of a GRPO group finish close together but not at
once. The judge is the one place every call passes, so it batches there without a wait: calls made in the same
event-loop turn share a batch, and while every worker is busy new calls queue and leave together as the next
batch (up to judge.batch_size). An idle judge adds no latency; a busy one hands batched functions (a reward
model, an LLM judge) the larger batches they are efficient on. Agents keep their one-sample interface.

Combining (TRL's rule): reward = sum of weight * value over the functions that gave a value; None means that
function has no reward for that sample. A sample every function gave None is rejected ("no_reward"): counted,
not trained on. A function that raises, hangs, crashes or returns the wrong number of values costs the samples
of its call (rejected with that reason), never the run; the others of the batch are rejected too, since their
reward would be missing a term.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from relayrl.judge.functions import BATCHED, RewardFunction, batch_arguments, batch_values, row_value
from relayrl.judge.pool import TimeoutPool

Req = TypeVar("Req")
Res = TypeVar("Res")


class Coalescer(Generic[Req, Res]):
    """Runs `run(batch)` on batches of submitted requests, at most `concurrency` batches at a time.

    A cancelled `submit` stops waiting; when every request of a running batch was cancelled, the batch is too
    (its worker calls are killed, as a cancelled single call's are). One event loop at a time, like the pool.
    """

    def __init__(self, run: Callable[[list[Req]], Awaitable[list[Res]]], max_batch: int, concurrency: int):
        if max_batch < 1 or concurrency < 1:
            raise ValueError(f"max_batch and concurrency must be >= 1, got {max_batch}, {concurrency}")
        self.run, self.max_batch, self.concurrency = run, max_batch, concurrency
        self._loop: asyncio.AbstractEventLoop | None = None
        self.batch_sizes: list[int] = []  # every batch's size, for metrics and tests

    def _reset(self, loop: asyncio.AbstractEventLoop) -> None:
        """Fresh state for a new event loop (an earlier loop's requests ended with it)."""
        self._loop, self._pending, self._running, self._scheduled = loop, [], 0, False
        self._tasks: dict[asyncio.Future[Res], asyncio.Task[None]] = {}

    async def submit(self, req: Req) -> Res:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._reset(loop)
        fut: asyncio.Future[Res] = loop.create_future()
        self._pending.append((req, fut))
        if not self._scheduled:  # once per loop turn: calls made in the same turn share a batch
            self._scheduled = True
            loop.call_soon(self._start)
        try:
            return await fut
        except asyncio.CancelledError:
            task = self._tasks.get(fut)
            if task is not None and all(f.done() for f, t in self._tasks.items() if t is task):
                task.cancel()  # nobody waits for this batch any more
            raise

    def _start(self) -> None:
        self._scheduled = False
        while self._running < self.concurrency:
            self._pending = [(r, f) for r, f in self._pending if not f.done()]
            if not self._pending:
                return
            batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch:]
            self._running += 1
            task = asyncio.get_running_loop().create_task(self._run(batch))
            self._tasks |= dict.fromkeys((f for _, f in batch), task)

    async def _run(self, batch: list[tuple[Req, asyncio.Future[Res]]]) -> None:
        self.batch_sizes.append(len(batch))
        try:
            results = await self.run([r for r, _ in batch])
            for (_, fut), res in zip(batch, results, strict=True):
                if not fut.done():
                    fut.set_result(res)
        except BaseException as e:  # never leave a waiter hanging; a cancellation still propagates
            for _, fut in batch:
                if not fut.done():
                    fut.cancel() if isinstance(e, asyncio.CancelledError) else fut.set_exception(e)
            if isinstance(e, asyncio.CancelledError):
                raise
        finally:
            for _, fut in batch:
                self._tasks.pop(fut, None)
            self._running -= 1
            if self._pending:
                self._start()


@dataclass
class Request:
    """One text to score against its row (the unit agents submit)."""

    text: str
    row: dict[str, Any]
    uid: str
    ids: list[int] | None = None


@dataclass
class Failed:
    """A function's call that cost `n` samples (all of a batched call, or one row call)."""

    f: RewardFunction
    error: Exception
    n: int


Failure = Callable[[Failed], tuple[str, str]]  # -> (reason, one-line text)
Scored = tuple[float | None, dict[str, float], tuple[str, str] | None]  # reward, metrics, (reason, text)


@dataclass
class BatchScorer:
    """Runs reward `functions` on a batch of requests in `pool` and combines their values (module docstring)."""

    functions: list[RewardFunction]
    pool: TimeoutPool
    kwargs: dict[str, Any]
    timeout: float
    bound: float | None
    failure: Failure  # how an exception reads as a rejection reason and one-line text

    async def score(self, batch: list[Request]) -> list[Scored]:
        """(reward or None, metrics, failure or None) per request; never raises (but for cancellation)."""
        per_fn = await asyncio.gather(*(self._values(f, batch) for f in self.functions))
        return [self._combine([vals[i] for vals in per_fn], len(batch)) for i in range(len(batch))]

    async def _values(self, f: RewardFunction, batch: list[Request]) -> list[Any]:
        """f's (value, metrics) per request, or the Failed call that cost it."""
        if f.style == BATCHED:
            args = batch_arguments(f, [r.text for r in batch], [r.row for r in batch], [r.ids for r in batch],
                                   self.kwargs)
            try:
                out = await self.pool.call("relayrl.judge.functions:call_batched", (f.path, args),
                                           timeout=self.timeout)
                return [(v, {}) for v in batch_values(out, len(batch), self.bound)]
            except Exception as e:  # CancelledError is a BaseException and propagates
                return [Failed(f, e, len(batch))] * len(batch)
        return await asyncio.gather(*(self._row_value(f, r) for r in batch))

    async def _row_value(self, f: RewardFunction, r: Request) -> tuple[float | None, dict[str, float]] | Failed:
        try:
            out = await self.pool.call(f.path, (r.text, r.row), self.kwargs, timeout=self.timeout)
            return row_value(out, self.bound)
        except Exception as e:
            return Failed(f, e, 1)

    def _combine(self, values: list[Any], n: int) -> Scored:
        failed = next((v for v in values if isinstance(v, Failed)), None)
        if failed is not None:
            return None, {}, self.failure(failed)
        metrics: dict[str, float] = {}
        reward, given = 0.0, []
        for f, (value, extra) in zip(self.functions, values, strict=True):
            metrics |= extra
            if value is not None:
                metrics[f"reward/{f.name}"] = value
                reward += f.weight * value
                given.append(f.name)
            else:  # counted per function: a judge whose replies stop parsing shows as a rising share
                metrics[f"reward_none/{f.name}"] = 1.0
        if not given:
            names = ", ".join(f.name for f in self.functions)
            return None, metrics, ("no_reward", f"judge: every reward function returned None for this sample ({names})")
        return reward, metrics, None
