"""What both schedulers share: running one agent safely, running a group, and group filters."""

from __future__ import annotations

import asyncio
import traceback
from collections import Counter
from collections.abc import Callable

from relayrl.agents.base import Agent
from relayrl.common.errors import InputError
from relayrl.common.imports import import_from_path
from relayrl.judge import REJECTED_PREFIX, reward_problem
from relayrl.sample import Sample, Status

GroupFilter = Callable[[list[Sample]], bool]


async def run_agent(agent: Agent, sample: Sample, timeout: float | None) -> list[Sample]:
    """Run one trajectory; failures and timeouts are recorded on the sample instead of raised.

    An agent returns one sample, or several (e.g. an OpenAI-client episode with separate conversations).
    """
    try:
        out = await asyncio.wait_for(agent.generate_sample(sample), timeout)
        out = out if isinstance(out, list) else [out]
    except asyncio.CancelledError:
        raise
    except TimeoutError:
        sample.error = f"agent timed out after {timeout} s"
    except Exception as e:
        sample.error = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"
    else:
        check_agent_output(agent, out)
        reject_untrustworthy(out, None if agent.judge is None else agent.judge.max_abs_reward)
        return out
    sample.status = Status.FAILED
    return [sample]


class AgentContractError(InputError):
    """An agent broke its contract (a programming error, the same for every sample): the run stops and says so."""


_FINAL = (Status.COMPLETED, Status.FAILED, Status.REJECTED, Status.ABORTED)


def check_agent_output(agent: Agent, out: list) -> None:
    """Every returned object is a Sample in a final status: one left at INIT would be dropped silently, every step."""
    name = f"{type(agent).__module__}.{type(agent).__qualname__}.generate_sample"
    for s in out:
        if not isinstance(s, Sample):
            raise AgentContractError(f"{name} returned {type(s).__name__}, not a Sample (or a list of them)")
        if s.status not in _FINAL:
            raise AgentContractError(f"{name} returned a sample with status {s.status.value!r}: set sample.status "
                                     "to Status.COMPLETED (trainable) or Status.FAILED before returning it")


def rejection_reason(sample: Sample, bound: float | None) -> str | None:
    """Why a finished sample has no reward to train on: its judge rejected a judgement (any turn's), or a
    reward it carries (the sample's, a turn's) is not a finite number within `bound`. None: it is fine."""
    for key, value in sample.metrics.items():
        if key.startswith(REJECTED_PREFIX) and value:
            return key[len(REJECTED_PREFIX):]
    rewards = [sample.reward] + [r for t in sample.turns for r in (t.reward, t.step_reward)]
    return next((why for r in rewards if r is not None and (why := reward_problem(r, bound))), None)


def reject_untrustworthy(samples: list[Sample], bound: float | None) -> None:
    """Mark completed samples without a trustworthy reward REJECTED (never trained on, counted). Done here,
    after the agent, because agents set COMPLETED themselves and some set rewards without the judge."""
    for s in samples:
        why = rejection_reason(s, bound) if s.status == Status.COMPLETED else None
        if why is not None:
            s.status = Status.REJECTED
            s.metrics[REJECTED_PREFIX + why] = 1.0
            s.error = s.error or f"rejected: {why} reward {s.reward!r:.80}"


def rejection_counts(samples: list[Sample]) -> Counter[str]:
    """Rejected samples by reason (the metric suffix: nonfinite, out_of_range, invalid, timeout, ...)."""
    return Counter(next((k[len(REJECTED_PREFIX):] for k, v in s.metrics.items() if k.startswith(REJECTED_PREFIX)
                         and v), "invalid") for s in samples if s.status == Status.REJECTED)


def rejection_metrics(counts: Counter[str], suffix: str = "") -> dict[str, float]:
    """judge/rejected (always, so a clean run shows 0) and judge/rejected_<reason> for each reason seen."""
    out = {f"judge/rejected{suffix}": float(sum(counts.values()))}
    return out | {f"judge/rejected_{why}{suffix}": float(n) for why, n in sorted(counts.items())}


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
