"""PPO's critic and the pieces around it: GAE against a plain reference loop, the clipped value loss and
explained variance by hand, LR schedules at chosen steps, the critic on the real tiny model (packing
invariance, learning, state_dict), and 2-step training runs of the new presets through the real loop."""

import copy
import math
import random

import pytest
import torch
import yaml
from engines_for_tests import rollout

from relayrl.common.files import read_jsonl
from relayrl.config.schema import AlgoConfig, TrainConfig
from relayrl.models import load_model
from relayrl.run.build import build
from relayrl.run.loop import train_steps
from relayrl.trainer.algo import discounted_cumsum, explained_variance, gae, value_loss
from relayrl.trainer.controller import TrainController
from relayrl.trainer.engine import TrainEngine
from relayrl.trainer.packer import Packer
from relayrl.trainer.schedule import LRSchedule, lr_factor
from relayrl.trainer.value import Critic


# ---- GAE ----------------------------------------------------------------------------------------------------
def reference_gae(rewards, values, gamma, lam):
    """The textbook loop, one sequence at a time, in plain Python floats."""
    adv, last = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        next_value = values[t + 1] if t + 1 < len(rewards) else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        last = delta + gamma * lam * last
        adv[t] = last
    return adv, [a + v for a, v in zip(adv, values)]


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (1.0, 0.95), (0.9, 0.8), (0.99, 0.0)])
def test_gae_matches_the_reference_loop(gamma, lam):
    rng = random.Random(0)
    lengths = [1, 5, 17, 3, 8]
    rewards = [[rng.uniform(-1, 1) for _ in range(n)] for n in lengths]
    values = [[rng.uniform(-1, 1) for _ in range(n)] for n in lengths]
    adv, ret = gae([torch.tensor(r) for r in rewards], [torch.tensor(v) for v in values], gamma, lam)
    for i in range(len(lengths)):
        want_adv, want_ret = reference_gae(rewards[i], values[i], gamma, lam)
        assert adv[i].tolist() == pytest.approx(want_adv, abs=1e-5)
        assert ret[i].tolist() == pytest.approx(want_ret, abs=1e-5)


def test_gae_with_lambda_one_and_zero_values_is_the_return():
    adv, ret = gae([torch.tensor([0.0, 0.0, 1.0])], [torch.zeros(3)], gamma=0.5, lam=1.0)
    assert adv[0].tolist() == pytest.approx([0.25, 0.5, 1.0]) and ret[0].tolist() == pytest.approx([0.25, 0.5, 1.0])


def test_discounted_cumsum_by_hand():
    out = discounted_cumsum([torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0])], 0.5)
    # [1 + .5 * (2 + .5 * 3), 2 + .5 * 3, 3] and [4]
    assert out[0].tolist() == pytest.approx([2.75, 3.5, 3.0]) and out[1].tolist() == [4.0]


# ---- value loss, explained variance ---------------------------------------------------------------------------
def test_value_loss_by_hand():
    values = torch.tensor([1.0, 0.5, 1.0], requires_grad=True)
    old, returns = torch.tensor([0.8, 0.5, 0.0]), torch.tensor([0.0, 1.0, 1.0])
    loss, stats = value_loss(values, old, returns, weight=1 / 3, clip=0.2)
    # token 0: (1 - 0)^2 = 1 vs clipped V .8 + .2 = 1.0 -> 1: max 1; token 1: .25 both;
    # token 2: (1 - 1)^2 = 0 vs clipped V 0 + .2 -> (.2 - 1)^2 = .64 (clipped term wins)
    assert float(loss.detach()) == pytest.approx(0.5 * (1 + 0.25 + 0.64) / 3)
    assert stats["value_clip_frac"] == pytest.approx(1 / 3)
    loss.backward()
    # d/dV of .5 (V - R)^2 / 3 = (V - R) / 3; the clipped token's gradient is 0 (the clamp is saturated)
    assert values.grad.tolist() == pytest.approx([1 / 3, -0.5 / 3, 0.0])
    unclipped, _ = value_loss(values.detach(), old, returns, weight=1 / 3, clip=None)
    assert float(unclipped) == pytest.approx(0.5 * (1 + 0.25 + 0) / 3)


def test_explained_variance_by_hand():
    returns = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert explained_variance(returns.clone(), returns) == pytest.approx(1.0)
    assert explained_variance(torch.full((4,), 2.5), returns) == pytest.approx(0.0)
    # residuals [1, 0, 0, -1]: var 2/3 vs var(returns) 5/3
    assert explained_variance(torch.tensor([0.0, 2.0, 3.0, 5.0]), returns) == pytest.approx(1 - (2 / 3) / (5 / 3))


# ---- LR schedules -----------------------------------------------------------------------------------------------
def test_lr_factor_at_chosen_steps():
    const = [lr_factor(s, schedule="constant", warmup=4) for s in range(6)]
    assert const == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])
    lin = dict(schedule="linear", warmup=2, total=10, min_ratio=0.1)
    # after warmup p = (step - 2) / 8; factor = .1 + .9 (1 - p)
    assert [lr_factor(s, **lin) for s in (0, 1, 2, 6, 10, 12)] == pytest.approx([0.5, 1.0, 1.0, 0.55, 0.1, 0.1])
    cos = dict(schedule="cosine", total=4)
    # (1 + cos(pi * step / 4)) / 2
    assert [lr_factor(s, **cos) for s in range(5)] == pytest.approx(
        [1.0, (1 + math.cos(math.pi / 4)) / 2, 0.5, (1 - math.cos(math.pi / 4)) / 2, 0.0])
    with pytest.raises(ValueError, match="total_steps"):
        lr_factor(0, schedule="cosine")


def test_schedule_writes_lrs_and_round_trips():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    sched = LRSchedule("linear", total=4)
    assert sched.apply([opt, None]) == pytest.approx([0.1])
    sched.step()
    sched.step()
    assert sched.apply([opt]) == pytest.approx([0.05])  # 1 - 2/4
    again = LRSchedule("linear", total=4)
    again.load_state_dict(sched.state_dict())
    replacement = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    replacement.load_state_dict(opt.state_dict())  # "initial_lr" travels with the optimizer state
    assert again.apply([replacement]) == pytest.approx([0.05])


# ---- the critic on the real tiny model --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(tiny_path):
    return load_model(tiny_path)


def test_critic_values_start_at_zero_and_do_not_depend_on_packing(model, tiny_path):
    samples = rollout(model, max_new=8)
    critic = Critic.from_pretrained(tiny_path)
    torch.nn.init.normal_(critic.model.head.weight, std=0.5)  # non-zero values, to compare packings
    outs = []
    for packer in (Packer(30, 0), Packer(10_000, 0, share_prompt=True)):
        batch = packer.pack(samples)
        for mb in batch.micro_batches:
            batch.scatter("values", mb, critic.forward_values(mb))
        outs.append(torch.cat(batch.per_token["values"]))
    assert outs[0].numel() == sum(s.num_trained_tokens for s in samples) and outs[0].abs().max() > 0
    assert torch.allclose(outs[0], outs[1], atol=1e-5)
    fresh = Critic.from_pretrained(tiny_path)
    assert float(fresh.forward_values(Packer(10_000, 0).pack(samples).micro_batches[0]).abs().max()) == 0.0


def test_critic_learns_the_returns(model, tiny_path):
    samples = rollout(model, max_new=6)
    critic = Critic.from_pretrained(tiny_path, lr=1e-2)
    batch = Packer(10_000, 0).pack(samples)
    batch.per_token["returns"] = [torch.full((s.num_trained_tokens,), float(s.reward)) for s in samples]
    weight = 1 / sum(batch.lengths)
    losses = []
    for _ in range(15):
        for mb in batch.micro_batches:
            batch.scatter("values", mb, critic.forward_values(mb))
        stats = critic.train_step(batch.micro_batches, lambda mb, v: value_loss(
            v, batch.gather("values", mb), batch.gather("returns", mb), weight=weight, clip=None))
        losses.append(stats["value_loss"])
    assert losses[-1] < 0.5 * losses[0] and stats["critic_grad_norm"] > 0


def test_controller_state_dict_covers_critic_optimizers_and_schedule(model, tiny_path):
    samples = rollout(model, max_new=6)

    def make():
        algo = AlgoConfig(adv_estimator="gae", adv_mean="batch", adv_std="batch", critic_lr=1e-3)
        train = TrainConfig(lr=1e-3, lr_schedule="cosine", total_steps=3)
        return TrainController(TrainEngine(copy.deepcopy(model), lr=1e-3), algo, train, pad_id=0,
                               max_new_tokens=16)

    ctl = make()
    metrics = ctl.fit(samples)
    assert metrics["train/lr"] == pytest.approx(1e-3) and metrics["train/critic_lr"] == pytest.approx(1e-3)
    assert {"train/value_loss", "train/explained_var", "train/value_clip_frac", "train/critic_grad_norm"} <= set(
        metrics)
    state = copy.deepcopy(ctl.state_dict())
    other = make()
    other.load_state_dict(state)
    assert other.version == 1 and other.schedule.step_count == 1
    for (name, a), (_, b) in zip(ctl.critic.model.state_dict().items(), other.critic.model.state_dict().items()):
        assert torch.equal(a, b), name
    assert other.critic.optimizer.state_dict()["state"].keys() == ctl.critic.optimizer.state_dict()["state"].keys()
    # both continue identically: same lr (cosine step 1 of 3) in the next fit
    assert other.fit(samples)["train/lr"] == pytest.approx(1e-3 * (1 + math.cos(math.pi / 3)) / 2)
    critic_free = TrainController(TrainEngine(copy.deepcopy(model)), AlgoConfig(), TrainConfig(), pad_id=0,
                                  max_new_tokens=16)
    with pytest.raises(ValueError, match="critic"):
        critic_free.load_state_dict(state)


# ---- 2-step runs through the real loop ----------------------------------------------------------------------------
@pytest.mark.parametrize("preset, keys", [
    ("ppo", ["train/value_loss", "train/explained_var", "train/critic_lr", "train/value_clip_frac"]),
    ("gspo", ["train/ratio_mean", "train/ratio_max", "train/approx_kl_old"]),
    ("dapo", ["train/overlong_frac", "train/overlong_penalty_mean"]),
    ("reinforce_pp_baseline", ["train/kl_reward_mean", "train/kl_ref"]),
])
def test_two_training_steps_per_preset(preset, keys, tiny_run):
    cfg = tiny_run(**{"algo.preset": preset, "train.lr_schedule": "linear", "data.group_size": 4,
                      "data.eval.source": tiny_run.data, "eval.size": 2, "eval.n": 2,
                      "eval.temperature": 1.0, "eval.at_end": True, "sampling.max_new_tokens": 12,
                      "run.log_trajectories": False})
    c = build(cfg)
    try:
        train_steps(c)
        assert c.train_ctl.version == 2 and c.rollout_ctl.version == 2
        assert (c.train_ctl.critic is not None) == (preset == "ppo")
    finally:
        c.close()
    rows = [r for r in read_jsonl(c.run_dir / "metrics.jsonl") if "train/loss" in r]
    assert len(rows) == 2
    for key in keys + ["train/lr", "train/grad_norm"]:
        assert key in rows[0] and math.isfinite(rows[0][key]), key
    # linear over run.steps = 2: lr 1e-3 then 5e-4
    assert [r["train/lr"] for r in rows] == pytest.approx([1e-3, 5e-4])
    saved = yaml.safe_load((c.run_dir / "config.yaml").read_text())
    assert saved["algo"]["preset"] == preset and saved["train"]["total_steps"] == 2
    assert all(saved[section][k] == v for section, knobs in {
        "ppo": {"algo": {"adv_estimator": "gae"}, "train": {"minibatches": 2}},
        "gspo": {"algo": {"ratio_level": "sequence", "clip_high": 4e-4}},
        "dapo": {"algo": {"clip_high": 0.28, "overlong_buffer": 12 // 5}, "scheduler": {"group_filter": "mixed"}},
        "reinforce_pp_baseline": {"algo": {"kl_mode": "reward", "adv_std": "batch"}},
    }[preset].items() for k, v in knobs.items())
