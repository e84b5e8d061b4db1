"""Advantages, KL estimators, token weights and the clipped loss against values computed by hand."""

import math

import pytest
import torch

from relayrl.trainer.algo import (
    LossInputs,
    compute_advantages,
    kl_estimate,
    overlong_penalty,
    policy_loss,
    shape_rewards,
    token_weights,
    turn_end_rewards,
    whiten,
)

GROUPS = ["a"] * 4 + ["b"] * 4
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0])


def close(x, y, tol=1e-5):
    assert torch.allclose(torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y, dtype=torch.float32),
                          atol=tol), (x, y)


def test_grpo_advantages_group_mean_and_unbiased_std():
    # group a: mean .5, unbiased std sqrt(1/3); group b: mean .75, unbiased std .5
    a = 0.5 / math.sqrt(1 / 3)
    adv = compute_advantages(REWARDS, GROUPS, mean="group", std="group", eps=0.0)
    close(adv, [a, -a, -a, a, 0.5, 0.5, 0.5, -1.5])


def test_dr_grpo_advantages_are_centred_not_scaled():
    adv = compute_advantages(REWARDS, GROUPS, mean="group", std="none")
    close(adv, [0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75])


def test_rloo_leave_one_out_baseline():
    # r_i minus the mean of the other three samples of its group
    adv = compute_advantages(REWARDS, GROUPS, mean="group", std="none", leave_one_out=True)
    close(adv, [2 / 3, -2 / 3, -2 / 3, 2 / 3, 1 / 3, 1 / 3, 1 / 3, -1.0])


def test_batch_level_normalisation():
    mean = 5 / 8
    std = math.sqrt(sum((float(r) - mean) ** 2 for r in REWARDS) / 7)
    adv = compute_advantages(REWARDS, GROUPS, mean="batch", std="batch", eps=0.0)
    close(adv, [(float(r) - mean) / std for r in REWARDS])


def test_all_equal_group_gives_zero_advantage_not_nan():
    adv = compute_advantages(torch.tensor([1.0, 1.0, 0.0, 0.0]), ["x", "x", "y", "y"])
    close(adv, [0.0, 0.0, 0.0, 0.0])


def test_groups_need_not_be_contiguous():
    adv = compute_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), ["x", "y", "x", "y"], std="none")
    close(adv, [0.5, -0.5, -0.5, 0.5])


@pytest.mark.parametrize("leave_one_out", [True, False])
def test_singleton_groups_get_zero_advantage_never_an_error(leave_one_out):
    # group x: 2, 0 (RLOO: 2 - 0 = 2 and 0 - 2 = -2; mean baseline: +-1); y and z: one sample each -> 0
    adv = compute_advantages(torch.tensor([2.0, 5.0, 0.0, -3.0]), ["x", "y", "x", "z"], std="none",
                             leave_one_out=leave_one_out)
    close(adv, [2.0, 0.0, -2.0, 0.0] if leave_one_out else [1.0, 0.0, -1.0, 0.0])


def test_turn_end_rewards_by_hand():
    # response: gen gen | ctx ctx | gen gen gen | (empty turn) ; trained tokens: 5
    mask = [1, 1, 0, 0, 1, 1, 1]
    got = turn_end_rewards(mask, [(0, 2), (4, 7), (7, 7)], [0.5, 2.0, -1.0])
    close(got, [0.0, 0.5, 0.0, 0.0, 2.0 - 1.0])  # the empty last turn adds to the last trained token
    close(turn_end_rewards([0, 1, 1], [(1, 1), (1, 3)], [3.0, 1.0]), [3.0, 1.0])  # empty first turn: token 0


def test_kl_estimators_match_formulas():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    d = [0.5, -1.0]
    close(kl_estimate(logp, ref, "k1"), d)
    close(kl_estimate(logp, ref, "k2"), [x * x / 2 for x in d])
    close(kl_estimate(logp, ref, "k3"), [math.exp(-x) - 1 + x for x in d])
    assert float(kl_estimate(logp, logp, "k3").abs().max()) == 0.0
    with pytest.raises(ValueError):
        kl_estimate(logp, ref, "k4")


def test_token_weights():
    close(token_weights([2, 3], "token_mean"), [0.2] * 5)
    close(token_weights([2, 3], "seq_mean_token_mean"), [1 / 4, 1 / 4, 1 / 6, 1 / 6, 1 / 6])
    close(token_weights([2, 3], "seq_mean_token_sum_norm", norm_len=10), [1 / 20] * 5)
    with pytest.raises(ValueError):
        token_weights([2], "seq_mean_token_sum_norm")


def test_token_weights_leave_filtered_samples_out_of_every_mean():
    keep = [True, False, True]
    close(token_weights([2, 4, 3], "token_mean", keep=keep), [0.2] * 2 + [0.0] * 4 + [0.2] * 3)
    close(token_weights([2, 4, 3], "seq_mean_token_mean", keep=keep), [1 / 4] * 2 + [0.0] * 4 + [1 / 6] * 3)
    close(token_weights([2, 4, 3], "seq_mean_token_sum_norm", 10, keep), [1 / 20] * 2 + [0.0] * 4 + [1 / 20] * 3)
    close(token_weights([2, 3], "token_mean", keep=[False, False]), [0.0] * 5)


LOGP = [0.1, 0.4, -0.4, 0.5]  # log-ratios new - old, old logp = 0
ADV = [1.0, 1.0, -1.0, -1.0]


def _loss(logp, idx=slice(None), weights=None, **kw):
    n = len(LOGP)
    inp = LossInputs(old_logp=torch.zeros(n)[idx], advantages=torch.tensor(ADV)[idx],
                     weights=(weights if weights is not None else torch.full((n,), 1 / n))[idx],
                     stat_weight=1 / n, **kw)
    return policy_loss(logp[idx], None, inp, clip_low=0.2, clip_high=0.28)


def test_clipped_loss_by_hand():
    # token 1: r=e^.1 unclipped -> -r; token 2: r=e^.4 > 1.28 with A>0 -> clipped at -1.28;
    # token 3: r=e^-.4 < 0.8 with A<0 -> clipped at +0.8; token 4: r=e^.5 with A<0 -> unclipped +r
    expected = [-math.exp(0.1), -1.28, 0.8, math.exp(0.5)]
    logp = torch.tensor(LOGP, requires_grad=True)
    loss, stats = _loss(logp)
    assert float(loss.detach()) == pytest.approx(sum(expected) / 4, abs=1e-6)
    assert stats["clip_frac"] == pytest.approx(0.5)
    loss.backward()
    # d/dlogp of -r*A/4 is -r*A/4 for unclipped tokens, 0 for clipped ones
    close(logp.grad, [-math.exp(0.1) / 4, 0.0, 0.0, math.exp(0.5) / 4])


def test_loss_is_exact_across_micro_batches():
    full_logp = torch.tensor(LOGP, requires_grad=True)
    full, _ = _loss(full_logp)
    full.backward()
    split_logp = torch.tensor(LOGP, requires_grad=True)
    parts = [_loss(split_logp, slice(0, 1))[0], _loss(split_logp, slice(1, 4))[0]]
    sum(parts).backward()
    assert float(sum(parts).detach()) == pytest.approx(float(full.detach()), abs=1e-7)
    close(split_logp.grad, full_logp.grad, tol=1e-7)


def test_kl_and_entropy_terms():
    logp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -1.0])
    ent = torch.tensor([2.0, 3.0])
    inp = LossInputs(old_logp=logp.clone(), advantages=torch.zeros(2), weights=torch.full((2,), 0.5),
                     stat_weight=0.5, ref_logp=ref)
    loss, stats = policy_loss(logp, ent, inp, clip_low=0.2, clip_high=0.2, kl_coef=0.1, kl_estimator="k1",
                              entropy_coef=0.01)
    # advantages 0: loss = 0.1 * mean(k1) - 0.01 * mean(entropy) = 0.1 * -0.25 - 0.01 * 2.5
    assert float(loss) == pytest.approx(-0.025 - 0.025, abs=1e-6)
    assert stats["kl_ref"] == pytest.approx(-0.25)
    assert stats["entropy"] == pytest.approx(2.5)


def test_on_policy_ratio_is_one_and_gradient_is_reinforce():
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    inp = LossInputs(old_logp=None, advantages=torch.tensor([2.0, -1.0]), weights=torch.full((2,), 0.5),
                     stat_weight=0.5)
    loss, stats = policy_loss(logp, None, inp, clip_low=0.2, clip_high=0.2)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-(2.0 - 1.0) / 2)
    close(logp.grad, [-1.0, 0.5])  # -A * w
    assert stats["clip_frac"] == 0.0


def test_k1_and_k3_are_unbiased_and_k3_is_nonnegative():
    # samples of p; KL(p || q) = sum p log(p / q) exactly, against the estimators' sample means
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.3, 0.5])
    exact = float((p * (p / q).log()).sum())
    draws = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    logp, ref = p.log()[draws], q.log()[draws]
    assert float(kl_estimate(logp, ref, "k1").mean()) == pytest.approx(exact, abs=0.01)
    assert float(kl_estimate(logp, ref, "k3").mean()) == pytest.approx(exact, abs=0.01)
    assert float(kl_estimate(logp, ref, "k3").min()) >= 0.0


def test_overlong_penalty_by_hand():
    # max 10, buffer 4: no penalty up to 6 tokens, then -(L - 6) / 4, -1 at 10 (times the factor 0.5)
    got = overlong_penalty(torch.tensor([3, 6, 7, 8, 10, 12]), 10, 4, factor=0.5)
    close(got, [0.0, 0.0, -0.125, -0.25, -0.5, -0.5])
    close(overlong_penalty(torch.tensor([10]), 10, 0), [0.0])  # buffer 0: off


def test_shape_rewards_and_whiten_by_hand():
    close(shape_rewards(torch.tensor([1.0, 0.0, -3.0]), scale=2.0, bias=0.5, clip=2.0), [2.0, 0.5, -2.0])
    x = torch.tensor([1.0, 2.0, 3.0, 6.0])  # mean 3, unbiased std sqrt((4 + 1 + 0 + 9) / 3)
    std = math.sqrt(14 / 3)
    close(whiten(x, mean=True, std=True, eps=0.0), [(v - 3) / std for v in [1, 2, 3, 6]])
    close(whiten(x, mean=False, std=True, eps=0.0), [v / std for v in [1, 2, 3, 6]])
    close(whiten(x, mean=True, std=False), [-2.0, -1.0, 0.0, 3.0])


def test_sequence_ratio_is_the_geometric_mean_and_clips_whole_sequences():
    # two sequences: log-ratios [.1, .3] (mean .2) and [-.1] ; A = +1 and -1; clip .1 / .1
    logp = torch.tensor([0.1, 0.3, -0.1], requires_grad=True)
    inp = LossInputs(old_logp=torch.zeros(3), advantages=torch.tensor([1.0, 1.0, -1.0]),
                     weights=torch.tensor([0.25, 0.25, 0.5]), stat_weight=1 / 3, seq_lengths=[2, 1])
    loss, stats = policy_loss(logp, None, inp, clip_low=0.1, clip_high=0.1, ratio_level="sequence")
    # seq 1: s = e^.2 = 1.22 > 1.1 with A > 0 -> clipped, -1.1 per token; seq 2: s = e^-.1 = .905 >= .9,
    # A < 0 -> unclipped, +.905; weights: seq means then mean over the 2 sequences
    assert float(loss.detach()) == pytest.approx(0.5 * (-1.1) + 0.5 * math.exp(-0.1), abs=1e-6)
    assert stats["clip_frac"] == pytest.approx(2 / 3)
    loss.backward()
    close(logp.grad, [0.0, 0.0, 0.5 * math.exp(-0.1)])  # d(w * -s * A)/dlogp_t = -w * s * A


@pytest.mark.parametrize("value", [0.1, 0.3, 0.7, 0.9, 1.1, 1.3])
@pytest.mark.parametrize("n", [8, 16])
@pytest.mark.parametrize("leave_one_out", [True, False])
def test_a_group_of_equal_rewards_gets_exactly_zero_whatever_the_rounding(value, n, leave_one_out):
    # float32 means of eight 0.1s (or sixteen 1.1s) miss by one rounding step; divided by a ~0 std + eps that
    # gave every sample of the group -0.0074 (-0.106): a push on a group without any signal
    rewards = torch.tensor([value] * n + [0.0, 1.0])
    adv = compute_advantages(rewards, ["g"] * n + ["h", "h"], leave_one_out=leave_one_out)
    assert adv[:n].abs().max() == 0.0
    assert adv[n:].abs().min() > 0.5
