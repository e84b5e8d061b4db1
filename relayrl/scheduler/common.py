"""What both schedulers share: running one agent safely, running a group, and group filters."""

from __future__ import annotations

import asyncio
import traceback
from collections.abc import Callable

from relayrl.agents.base import Agent
from relayrl.sample import Sample, Status
from relayrl.utils import import_from_path

GroupFilter = Callable[[list[Sample]], bool]


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


async def run_group(group: list[Sample], agent: Agent, timeout: float | None) -> list[Sample]:
    """All samples of one prompt, concurrently (the engine shares their prompt prefill)."""
    done = await asyncio.gather(*(run_agent(agent, s, timeout) for s in group))
    return [s for samples in done for s in samples]


def mixed_rewards(group: list[Sample]) -> bool:
    """DAPO's dynamic sampling: keep a group only if its rewards differ (else every advantage is zero)."""
    rewards = {float(s.reward or 0.0) for s in group if s.status == Status.COMPLETED}
    return len(rewards) > 1


def keep_all(group: list[Sample]) -> bool:
    return any(s.status == Status.COMPLETED for s in group)


def group_filter(spec: str) -> GroupFilter:
    """'none' | 'mixed' | 'package.module:function' (group -> keep?)."""
    if spec == "none":
        return keep_all
    if spec == "mixed":
        return mixed_rewards
    fn = import_from_path(spec)
    return lambda group: keep_all(group) and bool(fn(group))
