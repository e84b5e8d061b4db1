"""The async producer's admission clock: how long the staleness bound held it (`AsyncScheduler.held_s`).

Why it matters: on a GPU an async run waited for batches while its producer, allowed 24 groups, generated no
faster than sync's 64 rows (docs/benchmarks.md, "Fifth run"). Whether the staleness bound or the producer's own
speed held it is what `rollout/held_frac` tells; these tests pin what the clock counts."""

from __future__ import annotations

import asyncio

from relayrl.data import DataManager
from relayrl.sample import Sample, Status
from relayrl.scheduler import AsyncScheduler


class Instant:
    """A fake agent that answers at once (or after `delay` seconds)."""

    judge = None

    def __init__(self, delay: float = 0.0):
        self.delay = delay

    async def generate_sample(self, s: Sample) -> Sample:
        await asyncio.sleep(self.delay)
        s.append_generated([5, 6], [0.0, 0.0], [0, 0], "stop")
        s.reward, s.status = 1.0, Status.COMPLETED
        return s


def produce_for(sched: AsyncScheduler, agent: Instant, seconds: float) -> DataManager:
    data = DataManager([{"question": "q", "answer": "a"}] * 50, lambda row: [1, 2], group_size=2)

    async def run() -> None:
        task = asyncio.create_task(sched.produce_loop(data, agent))
        await asyncio.sleep(seconds)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(run())
    return data


def test_a_producer_at_the_staleness_bound_counts_the_time_it_is_held():
    sched = AsyncScheduler(batch_size=2, max_staleness=1, max_concurrency=64)  # 4 groups, then nothing
    data = produce_for(sched, Instant(), 1.5)
    assert sched.manager.accepted == 4 and len(data.replay_buffer.take(4, timeout=1)) == 4
    assert 1.0 <= sched.held_s <= 1.6  # held from the first moment it had made its 4 groups


def test_a_producer_at_max_concurrency_is_busy_not_held():
    sched = AsyncScheduler(batch_size=2, max_staleness=100, max_concurrency=1)  # one slow group at a time
    produce_for(sched, Instant(delay=0.3), 1.5)
    assert sched.manager.accepted >= 3
    assert sched.held_s == 0.0
