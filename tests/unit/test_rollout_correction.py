"""Rollout correction (relayrl.trainer.algo.rollout_correction) by hand: token and sequence ratios, truncation and
masking with both bounds, the veto, its diagnostics, the mismatch KL, and its order with decoupled PPO's clip."""

import math

import pytest
import torch

from relayrl.trainer.algo import LossInputs, mismatch_kl, policy_loss, reduce_stats, rollout_correction

# three trained tokens, sequences of 2 and 1: trainer / engine probabilities give ratios 2.5, 0.5 and 1
TRAINER = torch.tensor([0.5, 0.3, 0.9]).log()
ENGINE = torch.tensor([0.2, 0.6, 0.9]).log()
LENGTHS = [2, 1]


def close(t: torch.Tensor, want: list[float]) -> bool:
    return torch.allclose(t.double(), torch.tensor(want, dtype=torch.float64), atol=1e-6)


@pytest.mark.parametrize("mode, lower, weight, truncated, masked", [
    ("truncate", None, [2.0, 0.5, 1.0], [True, False, False], [False] * 3),  # TIS: only the cap
    ("truncate", 0.8, [2.0, 0.8, 1.0], [True, True, False], [False] * 3),  # both bounds move weights in
    ("mask", None, [0.0, 0.5, 1.0], [False] * 3, [True, False, False]),
    ("mask", 0.8, [0.0, 0.0, 1.0], [False] * 3, [True, True, False]),
])
def test_token_level_bounds_by_hand(mode, lower, weight, truncated, masked):
    c = rollout_correction(TRAINER, ENGINE, LENGTHS, level="token", mode=mode, upper=2.0, lower=lower)
    assert close(c.ratio, [2.5, 0.5, 1.0]) and close(c.weight, weight)
    assert c.truncated.tolist() == truncated and c.masked.tolist() == masked and c.vetoed.tolist() == [False, False]


@pytest.mark.parametrize("mode, weight", [("truncate", [1.2, 1.2, 1.0]), ("mask", [0.0, 0.0, 1.0])])
def test_sequence_level_is_the_product_of_token_ratios_not_their_geometric_mean(mode, weight):
    """Sequence 1's ratio is 2.5 * 0.5 = 1.25 on both tokens: above a cap of 1.2, where its geometric mean
    sqrt(1.25) = 1.118 (decoupled PPO's sequence level) would pass untouched."""
    c = rollout_correction(TRAINER, ENGINE, LENGTHS, level="sequence", mode=mode, upper=1.2)
    assert close(c.ratio, [1.25, 1.25, 1.0]) and close(c.weight, weight)
    assert (c.truncated if mode == "truncate" else c.masked).tolist() == [True, True, False]
    lower = rollout_correction(TRAINER, ENGINE, LENGTHS, level="sequence", mode=mode, upper=2.0, lower=1.1)
    assert close(lower.weight, [1.25, 1.25, 1.1 if mode == "truncate" else 0.0])  # sequence 2's 1.0 < 1.1


def test_a_long_sequence_ratio_is_computed_in_log_space():
    """50 tokens at ratio 1.01 multiply to 1.01^50 = 1.6446 (exactly, from a sum of logs); 100 at ratio 1.5 to
    e^40.5, which no float32 product of ratios would survive: reported at e^20 and truncated to the cap."""
    trainer, engine = torch.full((150,), math.log(0.5)), torch.cat([torch.full((50,), math.log(0.5 / 1.01)),
                                                                    torch.full((100,), math.log(0.5 / 1.5))])
    c = rollout_correction(trainer, engine, [50, 100], level="sequence", upper=2.0)
    assert c.ratio[0].item() == pytest.approx(1.01 ** 50, rel=1e-5)
    assert c.weight[0].item() == pytest.approx(1.6446, rel=1e-4)
    assert c.ratio[-1].item() == pytest.approx(math.exp(20), rel=1e-5) and c.weight[-1].item() == 2.0
    assert c.truncated.tolist() == [False] * 50 + [True] * 100


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_the_veto_zeroes_a_whole_sample_for_one_bad_token(level):
    """Token 2's ratio 0.5 is below a veto of 0.6: its whole sample weighs 0, even where its sequence ratio
    (1.25) is fine, and its tokens count as vetoed only (not also truncated)."""
    c = rollout_correction(TRAINER, ENGINE, LENGTHS, level=level, mode="truncate", upper=1.2, veto=0.6)
    assert c.vetoed.tolist() == [True, False] and close(c.weight, [0.0, 0.0, 1.0])
    assert c.truncated.tolist() == [False, False, False]
    kept = rollout_correction(TRAINER, ENGINE, LENGTHS, level=level, upper=1.2, veto=0.4)  # 0.5 >= 0.4: kept
    assert kept.vetoed.tolist() == [False, False] and kept.weight[0].item() == pytest.approx(1.2)


def test_diagnostics_by_hand_add_up_across_parts():
    c = rollout_correction(TRAINER, ENGINE, LENGTHS, mode="truncate", upper=2.0, veto=0.6)
    s = c.stats(token_share=1 / 3, sample_share=1 / 2)
    assert s["rollout_is_mean"] == pytest.approx(4.0 / 3) and s["rollout_is_min"] == pytest.approx(0.5)
    assert s["rollout_is_max"] == pytest.approx(2.5) and s["rollout_is_vetoed_frac"] == 0.5
    assert s["rollout_is_truncated_frac"] == 0.0 and s["rollout_is_masked_frac"] == 0.0  # token 1 is vetoed
    # the same batch in two micro-batches (one sequence each): shares add, min and max combine
    a = rollout_correction(TRAINER[:2], ENGINE[:2], [2], upper=2.0, veto=0.6).stats(1 / 3, 1 / 2)
    b = rollout_correction(TRAINER[2:], ENGINE[2:], [1], upper=2.0, veto=0.6).stats(1 / 3, 1 / 2)
    assert reduce_stats([a, b], mean=False) == pytest.approx(s)


def test_mismatch_kl_is_k3_of_the_engine_against_the_trainer():
    """r - 1 - log r per token, r = pi_trainer / pi_engine: 2.5 - 1 - ln 2.5, 0.5 - 1 + ln 2, and 0."""
    assert close(mismatch_kl(ENGINE, TRAINER), [1.5 - math.log(2.5), math.log(2) - 0.5, 0.0])


def test_unknown_level_or_mode_is_an_error():
    with pytest.raises(ValueError, match="mode 'clip'"):
        rollout_correction(TRAINER, ENGINE, LENGTHS, mode="clip")
    with pytest.raises(ValueError, match="level 'geometric'"):
        rollout_correction(TRAINER, ENGINE, LENGTHS, level="geometric")


def test_order_with_the_ppo_clip_by_hand():
    """The weight pi_prox / pi_behav is bounded first, then multiplies PPO's clipped term around pi_prox.

    Without decoupled PPO the trainer's policy before the step (pi_old) takes pi_prox's place: the same numbers
    (tests/unit/test_rollout_correction_fit.py runs both through the trainer). Per token
    (clip 0.2, token mean over 3): t1 w = 2.5 -> 2.0, r = 0.55 / 0.5 = 1.1, A = +1: -2.0 * 1.1; t2 w = 0.5,
    r = 0.15 / 0.3 = 0.5, A = -1: the clipped 0.8 * -1 wins the min, -0.5 * -0.8 = +0.4 (and no gradient);
    t3 w = 1, r = 1.1, A = +1: -1.1. Loss (-2.2 + 0.4 - 1.1) / 3; gradient d/dlogp = -w * r * A / 3 unclipped."""
    prox = TRAINER
    corr = rollout_correction(prox, ENGINE, LENGTHS, level="token", mode="truncate", upper=2.0)
    logp = torch.tensor([0.55, 0.15, 0.99]).log().requires_grad_(True)
    inp = LossInputs(old_logp=prox, advantages=torch.tensor([1.0, -1.0, 1.0]), weights=torch.full((3,), 1 / 3),
                     stat_weight=1 / 3, behav_weight=corr.weight, seq_lengths=LENGTHS)
    loss, stats = policy_loss(logp, None, inp, clip_low=0.2, clip_high=0.2)
    assert loss.item() == pytest.approx(-2.9 / 3, abs=1e-6)
    assert stats["clip_frac"] == pytest.approx(1 / 3)  # t2 is clipped around pi_prox
    loss.backward()
    assert close(logp.grad, [-2.0 * 1.1 / 3, 0.0, -1.1 / 3])
