"""Algorithm fixes of issue 14 against values computed by hand: groups left with one sample are dropped and
counted (never an error), per-turn rewards under GAE sit on each turn's last token, and an async producer
counts rejected samples by reason."""

import asyncio
import math
from types import SimpleNamespace

import pytest
import torch

from relayrl.config.schema import AlgoConfig, TrainConfig
from relayrl.data import DataManager
from relayrl.models import load_model
from relayrl.sample import Sample, Status
from relayrl.scheduler import AsyncScheduler
from relayrl.trainer.controller import TrainController
from relayrl.trainer.engine import TrainEngine


@pytest.fixture(scope="module")
def engine(tiny_path):
    return TrainEngine(load_model(tiny_path), lr=1e-3)


def sample(group, rewards, lengths=None, index=0):
    """One sample; several rewards make several turns (2 tokens each, 2 context tokens between them)."""
    s = Sample(prompt_ids=[1, 2, 3], group_id=group, index=index)
    for j, r in enumerate(rewards):
        if j:
            s.append_context([8, 9])
        n = (lengths or [2] * len(rewards))[j]
        s.append_generated([10 + j] * n, [0.0] * n, [0] * n, "stop")
        if len(rewards) > 1:
            s.turns[-1].step_reward = r
    s.reward = rewards[0] if len(rewards) == 1 else None
    return s


@pytest.mark.parametrize("preset", ["rloo", "grpo"])
def test_a_group_left_with_one_sample_is_dropped_and_counted(engine, preset):
    algo = AlgoConfig(adv_mean="group", adv_std="none" if preset == "rloo" else "group",
                      adv_leave_one_out=preset == "rloo")
    ctl = TrainController(engine, algo, TrainConfig(lr=1e-3), pad_id=0, max_new_tokens=8)
    batch = [sample("g0", [1.0]), sample("g0", [0.0], index=1), sample("g1", [1.0]), sample("g2", [0.5])]
    kept, dropped = ctl.drop_small_groups(batch)
    assert kept == batch[:2] and dropped == {"train/groups_dropped_small": 2.0, "train/samples_dropped_small": 2.0}
    adv = ctl.compute_advantages(ctl.packer.pack(kept)).per_token["advantages"]
    # RLOO: 1 - 0 and 0 - 1; GRPO: (1 - .5) / std and (0 - .5) / std with the unbiased std sqrt(.5)
    a = 1.0 if preset == "rloo" else 0.5 / math.sqrt(0.5)
    assert torch.cat(adv).tolist() == pytest.approx([a, a, -a, -a], abs=1e-5)
    metrics = ctl.fit(batch)  # through the whole step: trains on g0 alone, no error
    assert metrics["train/groups_dropped_small"] == 2.0 and metrics["train/samples"] == 2.0
    only_small = ctl.fit([sample("g3", [1.0])])
    assert only_small["train/skipped"] == 1.0 and only_small["train/groups_dropped_small"] == 1.0
    batch_level = TrainController(engine, AlgoConfig(adv_mean="batch", adv_std="batch"), TrainConfig(), pad_id=0,
                                  max_new_tokens=8)
    assert batch_level.drop_small_groups(batch) == (batch, {})  # no group statistics: every sample counts


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.5, 1.0), (0.5, 0.5)])
def test_gae_puts_each_turns_reward_on_its_last_token(engine, gamma, lam):
    algo = AlgoConfig(adv_estimator="gae", adv_mean="none", adv_std="none", gamma=gamma, lam=lam)
    ctl = TrainController(engine, algo, TrainConfig(), pad_id=0, max_new_tokens=8, critic=SimpleNamespace())
    two_turns = sample("g", [0.5, 2.0])  # trained tokens t0 t1 | t2 t3: 0.5 on t1, 2.0 on t3
    one_turn = sample("g", [1.0], lengths=[3], index=1)  # the sample reward on its last token
    batch = ctl.packer.pack([two_turns, one_turn])
    values = [[0.1, 0.2, 0.3, 0.4], [0.0, 0.5, 0.0]]
    batch.per_token["values"] = [torch.tensor(v) for v in values]
    adv = ctl.compute_advantages(batch).per_token["advantages"]

    def by_hand(rewards, v):  # delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}
        out, running = [], 0.0
        for t in reversed(range(len(rewards))):
            nxt = v[t + 1] if t + 1 < len(v) else 0.0
            running = rewards[t] + gamma * nxt - v[t] + gamma * lam * running
            out.append(running)
        return out[::-1]

    assert adv[0].tolist() == pytest.approx(by_hand([0.0, 0.5, 0.0, 2.0], values[0]), abs=1e-6)
    assert adv[1].tolist() == pytest.approx(by_hand([0.0, 0.0, 1.0], values[1]), abs=1e-6)
    if gamma == lam == 1.0:  # zero values would make it the reward-to-go: 2.5, 2.5, 2, 2 (here minus V_t)
        assert adv[0].tolist() == pytest.approx([2.5 - 0.1, 2.5 - 0.2, 2.0 - 0.3, 2.0 - 0.4], abs=1e-6)


class NaNEveryOther:
    """A fake agent: even samples get a NaN reward, odd ones 1.0 (no engine, no judge)."""

    judge = None

    async def generate_sample(self, s: Sample) -> Sample:
        s.append_generated([5, 6], [0.0, 0.0], [0, 0], "stop")
        s.reward, s.status = (float("nan") if s.index % 2 == 0 else 1.0), Status.COMPLETED
        return s


def test_async_producer_counts_rejections_and_keeps_them_out_of_the_buffer():
    data = DataManager([{"question": "q", "answer": "a"}], lambda row: [1, 2], group_size=4)
    sched = AsyncScheduler(batch_size=1, max_staleness=0)

    async def one_group() -> None:
        sched._wake = asyncio.Event()
        sched.manager.on_start()
        await sched._run(data.sample_from_dataset(), NaNEveryOther(), data)

    asyncio.run(one_group())
    asyncio.run(one_group())
    batch, metrics = sched.get_batch(data, version=0)
    assert [s.index for s in batch] == [1, 3] and all(s.reward == 1.0 for s in batch)
    assert metrics["judge/rejected_total"] == 4.0 and metrics["judge/rejected_nonfinite_total"] == 4.0
    assert sched.stats["rejected_nonfinite"] == 4  # in the stats a checkpoint saves
