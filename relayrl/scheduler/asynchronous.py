"""`AsyncScheduler`: rollouts run continuously beside training, with staleness bounded by admission.

Admission (AReaL's rule, counted in prompt groups): a new group may start only while

    accepted + running < (max_staleness + version + 1) * batch_size + extra   and   running < max_concurrency,

where `accepted` counts every group that finished and passed the filter (trained or waiting in the
buffer), `version` is the trainer's current policy version and `extra` = ceil(over_sample x batch_size) is
over-sampling (0 by default). With max_staleness = 0 and no over-sampling the producer can only start the groups
of the batch being trained next, which is synchronous on-policy training.

Admission bounds staleness for groups trained in order; a group that generates for much longer than
its peers can still finish too late. So the trainer side checks every batch: a group whose oldest
generated token is more than `max_staleness` versions behind is never trained -- it is marked EXPIRED,
its prompt goes back to the front of the queue, and a fresher group takes its place.

Over-sampling: the `extra` groups beyond the bound are never cancelled. Each batch is the first groups to finish,
so the slowest of a batch's groups no longer hold the trainer up; those still running go on as partial rollouts
(across weight updates) and are trained in a later batch. Their oldest tokens can be a version older than the plain
bound admits (more with over_sample > 1), so async over-sampling needs max_staleness >= 1 (SchedulerConfig checks
it); a group that turns out too stale is still expired, never trained.

The tail batch (tail_batch_candidate_step, tail_batch_trigger_size): a prompt whose answers are long keeps
expiring -- short groups overtake it, the trainer moves on, and it is generated again from scratch, as long as
before. After `candidate_step` expiries it is set aside instead (`DataManager.set_aside`); once `trigger_size`
prompts are set aside they run as a tail batch: up to batch_size of them start first (within the plain staleness
bound, no over-sampling), and nothing else starts until every one of them has finished, so no later group overtakes
them (the trainer still checks each against the bound). That is the reordering of long and short samples: short
groups train as they finish, long ones are held back and trained together, instead of each making a batch wait or
expiring again.

Evaluation goes first: `held()` (an evaluation's scheduler enters it, relayrl.scheduler.sync) stops new groups from
starting while it lasts; running ones go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator

from relayrl.agents.base import Agent
from relayrl.config.schema import SchedulerConfig
from relayrl.data.manager import EXPIRED_BEFORE, DataManager
from relayrl.sample import Sample, Status
from relayrl.scheduler.common import (
    GroupFilter,
    group_filter,
    keep_all,
    rejection_counts,
    rejection_metrics,
    run_group,
)


class StalenessManager:
    """Thread-safe admission counters (the producer admits on its loop, the trainer consumes)."""

    def __init__(self, batch_size: int, max_staleness: int, max_concurrency: int, extra: int = 0):
        self.batch_size, self.max_staleness, self.max_concurrency = batch_size, max_staleness, max_concurrency
        self.extra = extra  # over-sampled groups allowed beyond the staleness bound
        self.accepted = self.running = 0
        self._lock = threading.Lock()

    def _by_staleness(self, version: int, extra: int) -> int:
        """Groups the staleness bound (plus `extra`) still lets start at `version` (the caller holds the lock)."""
        return (self.max_staleness + version + 1) * self.batch_size + extra - (self.accepted + self.running)

    def capacity(self, version: int, over_sample: bool = True) -> int:
        """Groups that may start now; over_sample=False: within the plain bound (a tail batch's groups)."""
        with self._lock:
            extra = self.extra if over_sample else 0
            return min(self.max_concurrency - self.running, self._by_staleness(version, extra))

    def held_by_staleness(self, version: int) -> bool:
        """No group may start, and the staleness bound (not max_concurrency) is why."""
        with self._lock:
            return self._by_staleness(version, self.extra) <= 0 < self.max_concurrency - self.running

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


def expiries(group: list[Sample]) -> int:
    """How many times this group's prompt expired before this group was drawn."""
    return int(group[0].metrics.get(EXPIRED_BEFORE, 0))


class AsyncScheduler:
    def __init__(self, batch_size: int, *, max_staleness: int = 1, max_concurrency: int = 64,
                 agent_timeout: float | None = None, group_filter: GroupFilter = keep_all,
                 version_fn=lambda: 0, over_sample: float = 0.0, tail_batch_trigger_size: int = 0,
                 tail_batch_candidate_step: int = 0):
        self.manager = StalenessManager(batch_size, max_staleness, max_concurrency,
                                        extra=math.ceil(over_sample * batch_size))
        self.batch_size, self.max_staleness = batch_size, max_staleness
        self.agent_timeout, self.group_filter, self.version_fn = agent_timeout, group_filter, version_fn
        self.tail_trigger, self.tail_candidate = tail_batch_trigger_size, tail_batch_candidate_step
        self.stats = {"filtered": 0, "failed": 0, "expired": 0, "set_aside": 0, "tail_batches": 0}
        # seconds the producer had room below max_concurrency but the staleness bound held it: a producer that
        # idles waiting for the trainer's next version (or for its weights to arrive) shows here
        self.held_s = 0.0
        self._holds = 0  # evaluations running (`held`): no group starts meanwhile
        self._tail_left = self._tail_unstarted = 0  # the running tail batch's groups: not finished / not started
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def from_config(cls, s: SchedulerConfig, batch_size: int, agent_timeout: float | None,
                    version_fn: Callable[[], int]) -> AsyncScheduler:
        """The producer's scheduler as the scheduler section sets it; `version_fn`: the engines' weight version."""
        return cls(batch_size, max_staleness=s.max_staleness, max_concurrency=s.max_concurrency,
                   agent_timeout=agent_timeout, group_filter=group_filter(s.group_filter), version_fn=version_fn,
                   over_sample=s.over_sample, tail_batch_trigger_size=s.tail_batch_trigger_size,
                   tail_batch_candidate_step=s.tail_batch_candidate_step)

    # ---- producer side (on the Env's event loop) ------------------------------------------------
    async def produce_loop(self, data_mgr: DataManager, agent: Agent) -> None:
        """Keep admitting prompt groups until cancelled; a failure is handed to the waiting trainer."""
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        self._tail_left = self._tail_unstarted = 0  # a restart (after a checkpoint's pause) put them back
        tasks: set[asyncio.Task] = set()
        try:
            while True:
                while (drawn := self._draw(data_mgr)) is not None:
                    self.manager.on_start()
                    group, tail = drawn
                    task = asyncio.create_task(self._run(group, agent, data_mgr, tail))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                self._wake.clear()
                held = not self._holds and self.manager.held_by_staleness(self.version_fn())
                t_wait = time.perf_counter()
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

    def _draw(self, data_mgr: DataManager) -> tuple[list[Sample], bool] | None:
        """The next group to start and whether it belongs to a tail batch, or None: nothing may start now."""
        if self._holds:
            return None
        if not self._tail_left and self.tail_trigger and data_mgr.tail_size >= self.tail_trigger:
            self._tail_left = self._tail_unstarted = min(data_mgr.tail_size, self.batch_size)
            self.stats["tail_batches"] += 1
        if self._tail_left:  # its groups first, then nothing until they are all done
            if self._tail_unstarted and self.manager.capacity(self.version_fn(), over_sample=False) > 0:
                self._tail_unstarted -= 1
                return data_mgr.sample_from_tail(), True
            return None
        if self.manager.capacity(self.version_fn()) > 0:
            return data_mgr.sample_from_dataset(), False
        return None

    async def _run(self, group: list[Sample], agent: Agent, data_mgr: DataManager, tail: bool = False) -> None:
        before = expiries(group)
        try:
            samples = await run_group(group, agent, self.agent_timeout)
        except asyncio.CancelledError:  # the producer stopped: generate this prompt again (a checkpoint taken
            self.manager.on_finish(False)  # now must neither lose it nor train it twice)
            (data_mgr.set_aside if tail else data_mgr.requeue)(group[0].data, before)
            raise
        except BaseException as e:  # a bug outside the agents: stop the run, loudly
            data_mgr.replay_buffer.fail(e)
            raise
        for s in samples if before else ():  # agents may return new Sample objects: the count goes on with them
            s.metrics[EXPIRED_BEFORE] = float(before)
        self.stats["failed"] += sum(s.status == Status.FAILED for s in samples)
        for why, n in rejection_counts(samples).items():  # in stats, so a checkpoint keeps the totals
            self.stats[f"rejected_{why}"] = self.stats.get(f"rejected_{why}", 0) + n
        ok = self.group_filter(samples)
        self.stats["filtered"] += int(not ok)
        self.manager.on_finish(ok)
        if ok:
            data_mgr.add_to_replay_buffer(samples)
        if tail:
            self._tail_left -= 1
        self._wake.set()

    def notify(self) -> None:
        """Wake the producer (from any thread): the version changed or capacity was freed."""
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """No new group starts inside this context (enter it on the producer's loop): an evaluation runs first."""
        self._holds += 1
        try:
            yield
        finally:
            self._holds -= 1
            self.notify()

    # ---- trainer side (the main thread; `expire` also in a producer process) ---------------------
    def expire(self, data_mgr: DataManager, row: dict, expired: int) -> None:
        """A group of `row` was too stale to train, its prompt's `expired`-th expiry: generate it again first, or
        after tail_batch_candidate_step expiries set it aside for a tail batch."""
        self.stats["expired"] += 1
        if self.tail_candidate and expired >= self.tail_candidate:
            data_mgr.set_aside(row, expired)
            self.stats["set_aside"] += 1
        else:
            data_mgr.requeue(row, expired)
        self.manager.on_expire()
        self.notify()

    def get_batch(self, data_mgr: DataManager, version: int, timeout: float | None = None) -> tuple[list, dict]:
        """batch_size groups no staler than max_staleness at `version` (expired ones are regenerated)."""
        batch, metrics = take_fresh(lambda n: data_mgr.replay_buffer.take(n, timeout), self.batch_size, version,
                                    self.max_staleness,
                                    lambda group: self.expire(data_mgr, group[0].data, expiries(group) + 1))
        rejected = Counter({k[len("rejected_"):]: v for k, v in self.stats.items() if k.startswith("rejected_")})
        tail = {"rollout/tail_set_aside_total": float(self.stats["set_aside"]),
                "rollout/tail_batches_total": float(self.stats["tail_batches"]),
                "rollout/tail_waiting": float(data_mgr.tail_size)} if self.tail_trigger else {}
        return batch, metrics | tail | {"rollout/failed_total": float(self.stats["failed"]),
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
