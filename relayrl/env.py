"""`Env`: an agent plus a scheduler, driven from ordinary synchronous code.

Agents, judges and engine calls are asyncio coroutines; the training loop is plain Python. The Env
owns an event loop on a background thread and exposes `produce_batch()` as a blocking call, so the
main loop reads like seed 002's pseudo-code while many trajectories run concurrently underneath.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any

from relayrl.agents.base import Agent
from relayrl.data.manager import DataManager
from relayrl.scheduler import SyncScheduler


class Env:
    def __init__(self, agent: Agent, scheduler: SyncScheduler | None = None):
        self.agent = agent
        self.scheduler = scheduler or SyncScheduler()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="relayrl-env-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run a coroutine on the Env's loop and wait for it; Ctrl-C cancels it."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def produce_batch(self, data_mgr: DataManager, batch_size: int, agent: Agent | None = None) -> dict:
        """Generate `batch_size` prompt groups into `data_mgr`'s replay buffer; returns scheduler stats."""
        return self.run(self.scheduler.produce_batch(batch_size, data_mgr, agent or self.agent))

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
        if not self.loop.is_running():
            self.loop.close()
