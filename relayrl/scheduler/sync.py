"""`SyncScheduler`: start a batch of prompt groups, wait for them, fill the replay buffer.

Options: over-sampling (start more groups than the batch needs and keep the first that finish, which
cuts the long tail; the rest are cancelled and their engine slots freed) and a group filter (e.g. drop
groups whose rewards are all equal, DAPO's dynamic sampling) that keeps the batch size by starting
replacement groups, up to `max_attempts_factor` x batch size attempts.

An evaluation beside an asynchronous producer runs on a SyncScheduler that `preempts` it: while the evaluation's
batch is produced the producer starts no new group (`AsyncScheduler.held`) and the engine serves the evaluation's
requests before the producer's waiting ones (relayrl.engine.priority).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

from relayrl.agents.base import Agent
from relayrl.config.schema import SchedulerConfig
from relayrl.data.manager import DataManager
from relayrl.engine.priority import urgent
from relayrl.sample import Status
from relayrl.scheduler.asynchronous import AsyncScheduler
from relayrl.scheduler.common import (
    GroupFilter,
    group_filter,
    keep_all,
    rejection_counts,
    rejection_metrics,
    run_group,
)

logger = logging.getLogger(__name__)


class SyncScheduler:
    def __init__(self, agent_timeout: float | None = None, *, over_sample: float = 0.0,
                 group_filter: GroupFilter = keep_all, max_attempts_factor: float = 4.0,
                 preempts: AsyncScheduler | None = None):
        self.agent_timeout, self.over_sample = agent_timeout, over_sample
        self.group_filter, self.max_attempts_factor = group_filter, max_attempts_factor
        self.preempts = preempts

    @classmethod
    def from_config(cls, s: SchedulerConfig, agent_timeout: float | None) -> SyncScheduler:
        """The training scheduler as the scheduler section sets it (mode sync)."""
        return cls(agent_timeout, over_sample=s.over_sample, group_filter=group_filter(s.group_filter),
                   max_attempts_factor=s.max_attempts_factor)

    async def produce_batch(self, batch_size: int, data_mgr: DataManager, agent: Agent) -> dict[str, float]:
        if self.preempts is None:
            return await self._produce(batch_size, data_mgr, agent)
        with self.preempts.held(), urgent():
            return await self._produce(batch_size, data_mgr, agent)

    async def _produce(self, batch_size: int, data_mgr: DataManager, agent: Agent) -> dict[str, float]:
        t0 = time.perf_counter()
        budget = max(batch_size, math.ceil(batch_size * self.max_attempts_factor))
        launched = min(budget, math.ceil(batch_size * (1 + self.over_sample)))
        pending = {self._start(data_mgr, agent) for _ in range(launched)}
        accepted, failed, filtered, rejected = [], 0, 0, rejection_counts([])
        while pending and len(accepted) < batch_size:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                group = task.result()
                failed += sum(s.status == Status.FAILED for s in group)
                rejected += rejection_counts(group)
                if self.group_filter(group):
                    accepted.append(group)
                    continue
                filtered += 1
                if launched < budget:  # keep the batch size: try another prompt
                    pending.add(self._start(data_mgr, agent))
                    launched += 1
        for task in pending:  # over-sampled groups still running: not needed
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if len(accepted) < batch_size:
            logger.warning("only %d of %d groups passed the group filter after %d attempts",
                           len(accepted), batch_size, launched)
        for group in accepted[:batch_size]:
            data_mgr.add_to_replay_buffer(group)
        return {"rollout/failed": float(failed), "rollout/groups_filtered": float(filtered),
                "rollout/groups_dropped": float(len(pending) + max(0, len(accepted) - batch_size)),
                "time/rollout_s": time.perf_counter() - t0, **rejection_metrics(rejected)}

    def _start(self, data_mgr: DataManager, agent: Agent) -> asyncio.Task:
        return asyncio.ensure_future(run_group(data_mgr.sample_from_dataset(), agent, self.agent_timeout))
