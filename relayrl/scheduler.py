"""Schedulers decide how many trajectories are in flight and when a batch is ready.

`SyncScheduler` (seed 002): start `batch_size` prompt groups at once, wait for all of them, put the
finished samples in the replay buffer. An agent that raises or exceeds its timeout costs that one
sample (status FAILED, counted), never the batch.
"""

from __future__ import annotations

import asyncio
import time
import traceback

from relayrl.agents.base import Agent
from relayrl.data.manager import DataManager
from relayrl.sample import Sample, Status


async def run_agent(agent: Agent, sample: Sample, timeout: float | None) -> list[Sample]:
    """Run one trajectory; failures and timeouts are recorded on the sample instead of raised.

    An agent returns one sample, or several (e.g. an OpenAI-client episode with separate conversations).
    """
    try:
        out = await asyncio.wait_for(agent.generate_sample(sample), timeout)
        return out if isinstance(out, list) else [out]
    except asyncio.CancelledError:
        raise
    except TimeoutError:
        sample.error = f"agent timed out after {timeout} s"
    except Exception as e:
        sample.error = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"
    sample.status = Status.FAILED
    return [sample]


class SyncScheduler:
    def __init__(self, agent_timeout: float | None = None):
        self.agent_timeout = agent_timeout

    async def _generate_group(self, group: list[Sample], agent: Agent) -> list[Sample]:
        done = await asyncio.gather(*(run_agent(agent, s, self.agent_timeout) for s in group))
        return [s for samples in done for s in samples]

    async def produce_batch(self, batch_size: int, data_mgr: DataManager, agent: Agent) -> dict[str, float]:
        t0 = time.perf_counter()
        groups = [data_mgr.sample_from_dataset() for _ in range(batch_size)]
        done = await asyncio.gather(*(self._generate_group(g, agent) for g in groups))
        failed = 0
        for group in done:
            failed += sum(s.status == Status.FAILED for s in group)
            data_mgr.add_to_replay_buffer([s for s in group if s.status == Status.COMPLETED])
        return {"rollout/failed": float(failed), "time/rollout_s": time.perf_counter() - t0}
