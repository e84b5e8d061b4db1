"""The async producer's tail batch, its over-sampling, and evaluation going first: on a real LocalEngine over the tiny
model, the single-turn agent and a real DataManager; staleness is made by moving the engine's version by hand, so
every count below follows from the admission rule (relayrl.scheduler.asynchronous)."""

from __future__ import annotations

import time

import pytest

from relayrl.agents.single_turn import SingleTurnAgent
from relayrl.config import ConfigError
from relayrl.config.schema import load_run_config
from relayrl.data import DataManager
from relayrl.data.manager import EXPIRED_BEFORE
from relayrl.engine.base import SamplingParams
from relayrl.engine.local import LocalEngine
from relayrl.engine.priority import URGENT, urgent
from relayrl.engine.rollout import RolloutController
from relayrl.models import load_model, load_tokenizer
from relayrl.run.env import Env
from relayrl.scheduler import AsyncScheduler, SyncScheduler
from relayrl.scheduler.asynchronous import expiries

PARAMS = SamplingParams(max_new_tokens=3)


@pytest.fixture(scope="module")
def model(tiny_path):
    return load_model(tiny_path, dtype="float32")


@pytest.fixture(scope="module")
def tokenizer(tiny_path):
    return load_tokenizer(tiny_path)


def rows(n: int) -> list[dict]:
    return [{"question": f"q{i}", "answer": str(i)} for i in range(n)]


def data_for(n: int) -> DataManager:
    return DataManager(rows(n), lambda row: [5, 6, 10 + int(row["answer"])], group_size=2, shuffle=False)


def questions(batch) -> set[str]:
    return {s.data["question"] for s in batch}


def wait_for(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


class TimedAgent(SingleTurnAgent):
    """The single-turn agent, noting when each of its samples starts and ends and whether it ran as urgent."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.starts, self.ends, self.urgent = [], [], set()

    async def generate_sample(self, sample):
        self.starts.append(time.perf_counter())
        self.urgent.add(URGENT.get())
        out = await super().generate_sample(sample)
        self.ends.append(time.perf_counter())
        return out


def async_env(model, tokenizer, **sched_kwargs) -> tuple[Env, RolloutController, AsyncScheduler]:
    ctl = RolloutController([LocalEngine(model, eos_token_ids=[], max_batch_size=8)])
    sched = AsyncScheduler(2, version_fn=lambda: ctl.version, **sched_kwargs)
    return Env(TimedAgent(ctl, tokenizer, PARAMS), sched, SyncScheduler(preempts=sched)), ctl, sched


def test_a_prompt_is_set_aside_at_its_candidate_step_expiry():
    data = data_for(4)
    sched = AsyncScheduler(2, tail_batch_trigger_size=2, tail_batch_candidate_step=2)
    group = data.sample_from_dataset()
    assert questions(group) == {"q0"} and expiries(group) == 0
    sched.expire(data, group[0].data, expiries(group) + 1)  # the 1st expiry: generated again first
    group = data.sample_from_dataset()
    assert questions(group) == {"q0"} and expiries(group) == 1 and data.tail_size == 0
    sched.expire(data, group[0].data, expiries(group) + 1)  # the 2nd = candidate_step: set aside, not regenerated
    assert data.tail_size == 1 and questions(data.sample_from_dataset()) == {"q1"}
    assert sched.stats["expired"] == 2 and sched.stats["set_aside"] == 1
    state = data.state_dict()  # a checkpoint keeps the pool and the counts
    restored = data_for(4)
    restored.load_state_dict(state)
    group = restored.sample_from_tail()
    assert questions(group) == {"q0"} and expiries(group) == 2 and restored.tail_size == 0


def test_prompts_that_keep_expiring_run_as_a_tail_batch(model, tokenizer):
    env, ctl, sched = async_env(model, tokenizer, max_staleness=0, tail_batch_trigger_size=1,
                                tail_batch_candidate_step=1)
    data = data_for(8)
    try:
        env.start_producer(data)
        wait_for(lambda: len(data.replay_buffer) == 2)  # q0, q1 at version 0: (0 + 0 + 1) x 2, then the bound holds
        ctl.engines[0].set_version(1)
        env.notify_version()
        wait_for(lambda: len(data.replay_buffer) == 4)  # q2, q3 at version 1: (0 + 1 + 1) x 2 - 2 more
        batch, m = env.get_batch(data, 1, timeout=30)
        # q0 and q1 are one version stale at the trainer's version 1: expired once (= candidate_step), so set aside
        assert m["rollout/groups_expired"] == 2 and m["rollout/tail_set_aside_total"] == 2
        assert questions(batch) == {"q2", "q3"}
        batch, m = env.get_batch(data, 1, timeout=30)
        # the set-aside prompts (trigger_size 1) ran as tail batches before any new prompt, fresh (version 1): one
        # tail batch of both when the second was set aside before the producer looked, else one each
        assert questions(batch) == {"q0", "q1"} and {s.metrics[EXPIRED_BEFORE] for s in batch} == {1.0}
        assert m["rollout/groups_expired"] == 0 and m["rollout/tail_batches_total"] in (1, 2)
        assert m["rollout/tail_waiting"] == 0
        time.sleep(0.2)
        assert data.drawn == 6  # q0..q3 and the two tail groups; the bound at version 1 (4 accepted) admits no more
        assert sched.manager.accepted == 4 and sched.manager.running == 0
    finally:
        env.close()
        ctl.close()


def test_a_tail_batch_waits_for_its_trigger_size_then_runs_first_and_alone(model, tokenizer):
    env, ctl, sched = async_env(model, tokenizer, max_staleness=0, tail_batch_trigger_size=2,
                                tail_batch_candidate_step=1)
    data = data_for(8)
    data.set_aside(rows(8)[7], 1)  # one prompt set aside: below the trigger size
    try:
        env.start_producer(data)
        wait_for(lambda: len(data.replay_buffer) == 2)
        time.sleep(0.2)
        assert questions(g[0] for g in data.replay_buffer.groups()) == {"q0", "q1"} and data.tail_size == 1
        data.set_aside(rows(8)[6], 1)  # the second: a tail batch, once the bound at version 1 lets 2 more start
        ctl.engines[0].set_version(1)
        env.notify_version()
        wait_for(lambda: len(data.replay_buffer) == 4)
        time.sleep(0.2)
        groups = data.replay_buffer.groups()
        assert questions(g[0] for g in groups[2:]) == {"q6", "q7"} and data.drawn == 4 and data.tail_size == 0
        assert sched.stats["tail_batches"] == 1
    finally:
        env.close()
        ctl.close()


def test_async_over_sampling_keeps_the_extra_groups_for_the_next_batch(model, tokenizer):
    env, ctl, sched = async_env(model, tokenizer, max_staleness=1, over_sample=0.5)  # 1 extra group
    data = data_for(12)
    try:
        env.start_producer(data)
        wait_for(lambda: len(data.replay_buffer) == 5)  # (1 + 0 + 1) x 2 + 1 at version 0
        time.sleep(0.2)
        assert data.drawn == 5
        batch, m = env.get_batch(data, 0, timeout=30)
        assert len(batch) == 4 and m["rollout/groups_expired"] == 0
        assert len(data.replay_buffer) == 3  # nothing cancelled: the others wait for the next batch
        ctl.engines[0].set_version(1)
        env.notify_version()
        wait_for(lambda: data.drawn == 7)  # the bound at version 1: (1 + 1 + 1) x 2 + 1 = 7
        batch, m = env.get_batch(data, 1, timeout=30)
        # the next batch is the oldest of the kept groups (version 0, one behind: within max_staleness)
        assert len(batch) == 4 and m["rollout/groups_expired"] == 0 and {s.versions[0] for s in batch} == {0}
    finally:
        env.close()
        ctl.close()


def test_an_evaluation_holds_the_producer_and_goes_first(model, tokenizer):
    env, ctl, sched = async_env(model, tokenizer, max_staleness=100, max_concurrency=2)  # always generating
    data, evals = data_for(200), data_for(4)
    eval_agent = TimedAgent(ctl, tokenizer, PARAMS)
    train_agent = env.agent
    try:
        env.start_producer(data)
        wait_for(lambda: len(data.replay_buffer) >= 4)
        stats = env.produce_batch(evals, 4, agent=eval_agent)
        assert stats["rollout/failed"] == 0 and len(evals.get_batch()) == 8
        first, last = min(eval_agent.starts), max(eval_agent.ends)
        assert not [t for t in train_agent.starts if first <= t <= last]  # no training group started meanwhile
        assert eval_agent.urgent == {True} and train_agent.urgent == {False}
        wait_for(lambda: max(train_agent.starts) > last)  # and the producer goes on afterwards
    finally:
        env.close()
        ctl.close()


def test_urgent_requests_go_before_waiting_ones(model):
    engine = LocalEngine(model, eos_token_ids=[], max_batch_size=1)  # one at a time: the rest wait in line
    try:
        plain = [engine.submit([5, 6, i], SamplingParams(max_new_tokens=6)) for i in range(4)]
        with urgent():
            first = engine.submit([7, 8], SamplingParams(max_new_tokens=6))
        first.result(timeout=30)
        assert sum(f.done() for f in plain) <= 1  # at most the one already running; the 3 waiting come after
        assert all(len(f.result(timeout=30).output_ids) == 6 for f in plain)
    finally:
        engine.close()


@pytest.mark.parametrize("over, message", [
    ({"scheduler.tail_batch_trigger_size": 3, "scheduler.tail_batch_candidate_step": 1, "data.batch_size": 2},
     "scheduler.tail_batch_trigger_size: is 3, larger than the batch"),
    ({"scheduler.tail_batch_trigger_size": 2}, "scheduler.tail_batch_candidate_step: must be > 0"),
    ({"scheduler.over_sample": 0.5, "scheduler.max_staleness": 0}, "scheduler.over_sample: with mode=async needs"),
])
def test_bad_tail_and_over_sampling_settings_name_the_key(tiny_path, over, message):
    args = {"model.path": tiny_path, "scheduler.mode": "async", **over}
    with pytest.raises(ConfigError, match=message):
        load_run_config(None, [f"{k}={v}" for k, v in args.items()])
