"""Rollout correction through the trainer on the tiny model: behaviour logprobs shifted by known amounts give
known ratios (the fp32 engine and trainer agree to 2e-5, tests/unit/test_trainer.py), so the reported weights,
fractions and mismatch KL are checked by hand, with and without decoupled PPO, on both paths of the proximal
logprobs (the training forward's own, or a separate forward)."""

import copy
import dataclasses
import math

import pytest
import torch
from engines_for_tests import rollout

from relayrl.config.correction import RolloutCorrectionConfig
from relayrl.config.schema import AlgoConfig, TrainConfig
from relayrl.models import load_model
from relayrl.trainer.controller import TrainController
from relayrl.trainer.engine import TrainEngine

UP, DOWN = -0.9, 0.4  # engine logprob shifts: trainer / engine ratios e^0.9 = 2.46 (above a cap of 2) and e^-0.4


@pytest.fixture(scope="module")
def model(tiny_path):
    return load_model(tiny_path)


@pytest.fixture(scope="module")
def samples(model):
    """Real samples whose engine logprobs are shifted by UP on every third token and DOWN elsewhere."""
    out = rollout(model)
    for k, s in enumerate(out):
        s.logprobs = [lp + (UP if (k + t) % 3 == 0 else DOWN) for t, lp in enumerate(s.logprobs)]
    return out


def fit(model, samples, algo: AlgoConfig, train: TrainConfig = TrainConfig()) -> tuple[dict, torch.nn.Module]:
    ctl = TrainController(TrainEngine(copy.deepcopy(model), lr=1e-2), algo, train, pad_id=0, max_new_tokens=16)
    ctl.engine.optimizer = torch.optim.SGD(ctl.engine.model.parameters(), lr=1.0)  # weight change = gradient
    return ctl.fit(samples), ctl.engine.model


def expected(samples) -> tuple[float, float]:
    """(share of tokens shifted UP, mean k3 KL of the engine against the trainer), by hand from the shifts."""
    shifts = [UP if (k + t) % 3 == 0 else DOWN for k, s in enumerate(samples) for t in range(len(s.logprobs))]
    k3 = [math.exp(-d) - 1 + d for d in shifts]  # r - 1 - log r with r = e^-d
    return shifts.count(UP) / len(shifts), sum(k3) / len(k3)


CORRECT = RolloutCorrectionConfig(enabled=True, level="token", mode="truncate", upper=2.0, veto=1e-4)


@pytest.mark.parametrize("algo, train", [
    (AlgoConfig(rollout_correction=CORRECT), TrainConfig()),  # one update: pi_old is the training forward's
    (AlgoConfig(rollout_correction=CORRECT, decoupled=True, recompute_prox=True), TrainConfig()),  # pi_prox forward
    (AlgoConfig(rollout_correction=CORRECT), TrainConfig(minibatches=2)),  # pi_old from a separate forward
], ids=["one-update", "decoupled", "two-minibatches"])
def test_the_reported_weights_match_the_shifts(model, samples, algo, train):
    metrics, _ = fit(model, samples, algo, train)
    up_share, kl = expected(samples)
    assert metrics["train/rollout_is_truncated_frac"] == pytest.approx(up_share, abs=1e-9)
    assert metrics["train/rollout_is_max"] == pytest.approx(math.exp(-UP), rel=1e-3)
    assert metrics["train/rollout_is_min"] == pytest.approx(math.exp(-DOWN), rel=1e-3)
    mean = up_share * math.exp(-UP) + (1 - up_share) * math.exp(-DOWN)
    assert metrics["train/rollout_is_mean"] == pytest.approx(mean, rel=1e-3)
    assert metrics["train/mismatch_kl"] == pytest.approx(kl, rel=1e-3)
    assert metrics["train/rollout_is_masked_frac"] == 0 and metrics["train/rollout_is_vetoed_frac"] == 0
    assert "train/behav_weight_mean" not in metrics  # the correction is decoupled PPO's behaviour weight


def test_with_one_update_decoupled_ppo_changes_nothing_but_where_pi_prox_comes_from(model, samples):
    """pi_prox of one update is the policy being trained, so the correction with decoupled PPO (a separate
    forward) and without it (the training forward's own logprobs) must give the same update."""
    plain, a = fit(model, samples, AlgoConfig(rollout_correction=CORRECT))
    decoupled, b = fit(model, samples, AlgoConfig(rollout_correction=CORRECT, decoupled=True, recompute_prox=True))
    for key in ("train/loss", "train/rollout_is_mean", "train/mismatch_kl"):
        assert plain[key] == pytest.approx(decoupled[key], abs=1e-5), key
    for (n, x), (_, y) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.allclose(x, y, atol=1e-6, rtol=1e-5), n
    off, c = fit(model, samples, AlgoConfig())  # no weight at all: another update, the KL still measured
    assert off["train/mismatch_kl"] == pytest.approx(plain["train/mismatch_kl"], rel=1e-5)
    assert not any(k.startswith("train/rollout_is") for k in off)
    assert any(not torch.allclose(x, y) for x, y in zip(a.parameters(), c.parameters()))


def test_a_catastrophic_token_vetoes_its_sample(model, samples):
    """Sample 1's token 2 (shifted UP) gets 12 more in the engine: ratio e^(0.9 - 12) = 1.5e-5 < 1e-4. That sample
    weighs 0, counted once among the samples, and its tokens count as neither truncated nor masked."""
    bad = copy.deepcopy(samples)
    bad[1].logprobs[2] += 12.0
    metrics, _ = fit(model, bad, AlgoConfig(rollout_correction=dataclasses.replace(CORRECT, mode="mask")))
    assert metrics["train/rollout_is_vetoed_frac"] == pytest.approx(1 / len(bad))
    assert metrics["train/rollout_is_min"] == pytest.approx(math.exp(-UP - 12), rel=1e-2)
    up_share, _ = expected(bad)
    n = sum(len(s.logprobs) for s in bad)
    up_in_bad = sum(1 for t in range(len(bad[1].logprobs)) if (1 + t) % 3 == 0)
    assert metrics["train/rollout_is_masked_frac"] == pytest.approx(up_share - up_in_bad / n, abs=1e-9)

