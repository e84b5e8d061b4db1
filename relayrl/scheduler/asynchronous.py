"""`AsyncScheduler`: rollouts run continuously beside training, with staleness bounded by admission.

Admission (AReaL's rule, counted in prompt groups): a new group may start only while

    accepted + running < (max_staleness + version + 1) * batch_size   and   running < max_concurrency,

where `accepted` counts every group that finished and passed the filter (trained or waiting in the
buffer) and `version` is the trainer's current policy version. With max_staleness = 0 the producer can
only start the groups of the batch being trained next, which is synchronous on-policy training.

Admission bounds staleness for groups trained in order; a group that generates for much longer than
its peers can still finish too late. So the trainer side checks every batch: a group whose oldest
generated token is more than `max_staleness` versions behind is never trained -- it is marked EXPIRED,
its prompt goes back to the front of the queue (the tail batch), and a fresher group takes its place.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

from relayrl.agents.base import Agent
from relayrl.data.manager import DataManager
from relayrl.sample import Sample, Status
from relayrl.scheduler.common import GroupFilter, keep_all, rejection_counts, rejection_metrics, run_group


class StalenessManager:
    """Thread-safe admission counters (the producer admits on its loop, the trainer consumes)."""

    def __init__(self, batch_size: int, max_staleness: int, max_concurrency: int):
        self.batch_size, self.max_staleness, self.max_concurrency = batch_size, max_staleness, max_concurrency
        self.accepted = self.running = 0
        self._lock = threading.Lock()

    def _by_staleness(self, version: int) -> int:
        """Groups the staleness bound still lets start at `version` (the caller holds the lock)."""
        return (self.max_staleness + version + 1) * self.batch_size - (self.accepted + self.running)

    def capacity(self, version: int) -> int:
        with self._lock:
            return min(self.max_concurrency - self.running, self._by_staleness(version))

    def held_by_staleness(self, version: int) -> bool:
        """No group may start, and the staleness bound (not max_concurrency) is why."""
        with self._lock:
            return self._by_staleness(version) <= 0 < self.max_concurrency - self.running

    def on_start(self) -> None:
        with self._lock:
            self.running += 1

    def on_finish(self, accepted: bool) -> None:
        with self._lock:
            self.running -= 1
            self.accepted += int(accepted)

    def on_expire(self) -> None:
        with self._lock:
            self.accepted -= 1


def staleness(group: list[Sample], version: int) -> int:
    return max(s.staleness(version) for s in group)


class AsyncScheduler:
    def __init__(self, batch_size: int, *, max_staleness: int = 1, max_concurrency: int = 64,
                 agent_timeout: float | None = None, group_filter: GroupFilter = keep_all,
                 version_fn=lambda: 0):
        self.manager = StalenessManager(batch_size, max_staleness, max_concurrency)
        self.batch_size, self.max_staleness = batch_size, max_staleness
        self.agent_timeout, self.group_filter, self.version_fn = agent_timeout, group_filter, version_fn
        self.stats = {"filtered": 0, "failed": 0, "expired": 0}
        # seconds the producer had room below max_concurrency but the staleness bound held it: a producer that
        # idles waiting for the trainer's next version (or for its weights to arrive) shows here
        self.held_s = 0.0
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- producer side (on the Env's event loop) ------------------------------------------------
    async def produce_loop(self, data_mgr: DataManager, agent: Agent) -> None:
        """Keep admitting prompt groups until cancelled; a failure is handed to the waiting trainer."""
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        tasks: set[asyncio.Task] = set()
        try:
            while True:
                while self.manager.capacity(self.version_fn()) > 0:
                    self.manager.on_start()
                    task = asyncio.create_task(self._run(data_mgr.sample_from_dataset(), agent, data_mgr))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                self._wake.clear()
                held, t_wait = self.manager.held_by_staleness(self.version_fn()), time.perf_counter()
                # a timer too: the version may change unannounced. Not wait_for: on Python 3.11 it can swallow a
                # cancel that lands as its inner wait ends, and this loop ran on (stop_producer then waited 30 s
                # and a checkpoint would have seen prompts drawn after the stop)
                waiter = asyncio.ensure_future(self._wake.wait())
                try:
                    await asyncio.wait({waiter}, timeout=1.0)
                finally:
                    waiter.cancel()
                    if held:
                        self.held_s += time.perf_counter() - t_wait
        except BaseException as e:
            if not isinstance(e, asyncio.CancelledError):
                data_mgr.replay_buffer.fail(e)
            raise
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, group: list[Sample], agent: Agent, data_mgr: DataManager) -> None:
        try:
            samples = await run_group(group, agent, self.agent_timeout)
        except asyncio.CancelledError:  # the producer stopped: generate this prompt again (a checkpoint taken
            self.manager.on_finish(False)  # now must neither lose it nor train it twice)
            data_mgr.requeue(group[0].data)
            raise
        except BaseException as e:  # a bug outside the agents: stop the run, loudly
            data_mgr.replay_buffer.fail(e)
            raise
        self.stats["failed"] += sum(s.status == Status.FAILED for s in samples)
        for why, n in rejection_counts(samples).items():  # in stats, so a checkpoint keeps the totals
            self.stats[f"rejected_{why}"] = self.stats.get(f"rejected_{why}", 0) + n
        ok = self.group_filter(samples)
        self.stats["filtered"] += int(not ok)
        self.manager.on_finish(ok)
        if ok:
            data_mgr.add_to_replay_buffer(samples)
        self._wake.set()

    def notify(self) -> None:
        """Wake the producer (from any thread): the version changed or capacity was freed."""
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    # ---- trainer side (the main thread) ---------------------------------------------------------
    def get_batch(self, data_mgr: DataManager, version: int, timeout: float | None = None) -> tuple[list, dict]:
        """batch_size groups no staler than max_staleness at `version` (expired ones are regenerated)."""
        def expire(group: list[Sample]) -> None:
            self.stats["expired"] += 1
            data_mgr.requeue(group[0].data)
            self.manager.on_expire()
            self.notify()

        batch, metrics = take_fresh(lambda n: data_mgr.replay_buffer.take(n, timeout), self.batch_size, version,
                                    self.max_staleness, expire)
        rejected = Counter({k[len("rejected_"):]: v for k, v in self.stats.items() if k.startswith("rejected_")})
        return batch, metrics | {"rollout/failed_total": float(self.stats["failed"]),
                                 "rollout/groups_filtered_total": float(self.stats["filtered"]),
                                 **rejection_metrics(rejected, "_total")}


def take_fresh(take, batch_size: int, version: int, max_staleness: int, expire) -> tuple[list[Sample], dict]:
    """Take groups with `take(n)` until batch_size of them are within max_staleness of `version`;
    each stale group is marked EXPIRED and handed to `expire` (which re-queues its prompt)."""
    t0 = time.perf_counter()
    kept: list[list[Sample]] = []
    expired = 0
    while len(kept) < batch_size:
        for group in take(batch_size - len(kept)):
            if staleness(group, version) <= max_staleness:
                kept.append(group)
                continue
            for s in group:
                s.status = Status.EXPIRED
            expire(group)
            expired += 1
    batch = [s for g in kept for s in g]
    for s in batch:
        s.status = Status.ARCHIVED
    return batch, {"rollout/groups_expired": float(expired), "time/wait_for_batch_s": time.perf_counter() - t0}
