"""`Env`: an agent plus a scheduler, driven from ordinary synchronous code.

Agents, judges and engine calls are asyncio coroutines; the training loop is plain Python. The Env
owns an event loop on a background thread and exposes `produce_batch()` as a blocking call, so the
main loop reads as a plain sequence (produce a batch, train, sync weights) while many trajectories run
concurrently underneath. With an AsyncScheduler, `start_producer()` runs the scheduler's `produce_loop` on that
loop beside the
trainer, and `get_batch()` hands the trainer batches within the staleness bound.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any

from relayrl.agents.base import Agent
from relayrl.common.threads import release_openmp_threads
from relayrl.data.manager import DataManager
from relayrl.scheduler import AsyncScheduler, SyncScheduler


class Env:
    def __init__(self, agent: Agent, scheduler: SyncScheduler | AsyncScheduler | None = None,
                 eval_scheduler: SyncScheduler | None = None):
        self.agent = agent
        self.scheduler = scheduler or SyncScheduler()
        self.eval_scheduler = eval_scheduler or SyncScheduler()
        self._producer: asyncio.Task | None = None
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="relayrl-env-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run a coroutine on the Env's loop and wait for it; Ctrl-C cancels it."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            release_openmp_threads()  # this thread waits while engines compute (a LocalEngine's worker thread)
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def produce_batch(self, data_mgr: DataManager, batch_size: int, agent: Agent | None = None) -> dict:
        """Generate `batch_size` prompt groups into `data_mgr`'s replay buffer; returns scheduler stats.

        With an agent given (evaluation), the plain synchronous scheduler runs it, even beside a producer.
        """
        scheduler = self.scheduler if agent is None else self.eval_scheduler
        return self.run(scheduler.produce_batch(batch_size, data_mgr, agent or self.agent))

    # ---- asynchronous production ---------------------------------------------------------------
    def start_producer(self, data_mgr: DataManager) -> None:
        """Start the scheduler's produce_loop beside the caller: rollouts keep going while it trains."""
        if not isinstance(self.scheduler, AsyncScheduler):
            raise TypeError("start_producer needs an AsyncScheduler (scheduler.mode=async)")

        async def start() -> asyncio.Task:
            return asyncio.create_task(self.scheduler.produce_loop(data_mgr, self.agent))

        self._producer = self.run(start())

    @property
    def producing(self) -> bool:
        return self._producer is not None

    def get_batch(self, data_mgr: DataManager, version: int, timeout: float | None = None) -> tuple[list, dict]:
        """The next batch from the producer, no staler than the bound (blocks; re-raises producer errors)."""
        return self.scheduler.get_batch(data_mgr, version, timeout)

    def notify_version(self) -> None:
        """Tell an async producer that the policy version moved (its admission bound grew)."""
        if isinstance(self.scheduler, AsyncScheduler):
            self.scheduler.notify()

    def stop_producer(self, timeout: float = 30.0) -> None:
        """Cancel the producer and every trajectory it runs; their engine requests are dropped."""
        task, self._producer = self._producer, None
        if task is None or not self.loop.is_running():
            return
        self.loop.call_soon_threadsafe(task.cancel)
        waiter = asyncio.run_coroutine_threadsafe(asyncio.wait({task}), self.loop)
        with contextlib.suppress(concurrent.futures.TimeoutError):
            waiter.result(timeout=timeout)

    def close(self) -> None:
        """Stop the producer, then cancel and await every task left on the loop before stopping it: a task
        destroyed while pending would run its cleanup (`finally: await ...`) with no loop at garbage collection."""
        self.stop_producer()
        if self.loop.is_running():
            async def cancel_all() -> None:
                tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

            with contextlib.suppress(concurrent.futures.TimeoutError):
                asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result(timeout=10)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
        if not self.loop.is_running():
            self.loop.close()
