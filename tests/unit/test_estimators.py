"""The built-in advantage estimators on a small batch whose advantages are computed by hand in the comments, what
each declares (group-relative, needs a critic), and a bad algo.adv_estimator / algo.policy_loss.

The batch: group g0 = three samples with 2, 3 and 1 trained tokens and rewards 1, 0, 1; group g1 = two samples
with 1 and 2 tokens and rewards 1, 0.5.
"""

import pytest
import torch

from relayrl.common.errors import InputError
from relayrl.config.algo import AlgoConfig
from relayrl.sample import Sample
from relayrl.trainer.estimators import AdvantageInputs, estimator_for
from relayrl.trainer.estimators.gae import GAEEstimator
from relayrl.trainer.estimators.returns import ReturnEstimator
from relayrl.trainer.losses import loss_for
from relayrl.trainer.losses.ppo_clip import ppo_clip

LENGTHS, REWARDS, GROUPS = [2, 3, 1, 1, 2], [1.0, 0.0, 1.0, 1.0, 0.5], ["g0", "g0", "g0", "g1", "g1"]


def inputs(**extra) -> AdvantageInputs:
    samples = []
    for i, (n, g) in enumerate(zip(LENGTHS, GROUPS)):
        s = Sample(prompt_ids=[1, 2], group_id=g, index=i)
        s.append_generated([10 + t for t in range(n)], [-1.0] * n, [0] * n, "stop")
        samples.append(s)
    return AdvantageInputs(samples, torch.tensor(REWARDS), [(i, None) for i in range(5)], GROUPS, **extra)


def flat(out) -> list[float]:
    return torch.cat(out.advantages).tolist()


def test_return_with_the_group_mean_and_std_is_grpo():
    # g0: mean 2/3, unbiased std sqrt(((1/3)^2 * 2 + (2/3)^2) / 2) = sqrt(1/3): A = 1/sqrt(3), -2/sqrt(3), 1/sqrt(3)
    # g1: mean 0.75, std sqrt(2 * 0.25^2 / 1) = 0.25 * sqrt(2): A = +-1/sqrt(2); each on every token of its sample
    a, b = 3 ** -0.5, 2 ** -0.5
    out = estimator_for(AlgoConfig(adv_mean="group", adv_std="group")).estimate(inputs())
    assert flat(out) == pytest.approx([a, a, -2 * a, -2 * a, -2 * a, a, b, -b, -b], abs=1e-5)
    assert out.returns is None


def test_return_with_leave_one_out_is_rloo():
    # A_i = r_i - mean of the group's others: g0 1 - 0.5, 0 - 1, 1 - 0.5; g1 1 - 0.5, 0.5 - 1
    out = ReturnEstimator(AlgoConfig(adv_std="none", adv_leave_one_out=True)).estimate(inputs())
    assert flat(out) == pytest.approx([0.5, 0.5, -1, -1, -1, 0.5, 0.5, -0.5, -0.5], abs=1e-6)


def test_return_with_kl_in_the_reward_carries_the_kl_still_to_come():
    # no group step (REINFORCE++ whitens over the batch afterwards, in the controller): A_t = r - 0.5 * sum_{u>=t} kl_u
    kl = [torch.tensor([0.1, 0.2]), torch.zeros(3), torch.tensor([0.4]), torch.zeros(1), torch.tensor([0.2, 0.2])]
    out = ReturnEstimator(AlgoConfig(adv_mean="batch", adv_std="batch", kl_coef=0.5)).estimate(inputs(kl=kl))
    assert flat(out) == pytest.approx([0.85, 0.9, 0, 0, 0, 0.8, 1.0, 0.3, 0.4], abs=1e-6)


def test_gae_puts_the_reward_on_the_last_token_and_returns_the_critic_targets():
    # gamma 1, lam 0.5, values [0.5, 0.25] on sample 0 (reward 1): delta = [0 + 0.25 - 0.5, 1 - 0.25] = [-0.25, 0.75],
    # A = [-0.25 + 0.5 * 0.75, 0.75] = [0.125, 0.75], returns = A + V = [0.625, 1.0]; zero values elsewhere: the
    # reward itself on the last token, discounted by gamma * lam = 0.5 per token before it
    values = [torch.tensor([0.5, 0.25])] + [torch.zeros(n) for n in LENGTHS[1:]]
    est = estimator_for(AlgoConfig(adv_estimator="gae", adv_mean="none", adv_std="none", gamma=1.0, lam=0.5))
    out = est.estimate(inputs(values=values))
    assert flat(out) == pytest.approx([0.125, 0.75, 0, 0, 0, 1.0, 1.0, 0.25, 0.5], abs=1e-6)
    assert torch.cat(out.returns).tolist() == pytest.approx([0.625, 1.0, 0, 0, 0, 1.0, 1.0, 0.25, 0.5], abs=1e-6)
    with pytest.raises(ValueError, match="needs critic values"):
        est.estimate(inputs())


def test_each_estimator_declares_groups_and_critic_in_one_place():
    assert isinstance(estimator_for(AlgoConfig()), ReturnEstimator)
    assert estimator_for(AlgoConfig()).group_relative and not ReturnEstimator.needs_critic
    assert not estimator_for(AlgoConfig(adv_mean="batch", adv_std="batch")).group_relative
    assert estimator_for(AlgoConfig(adv_mean="group_batch", adv_std="batch")).group_relative
    assert GAEEstimator.needs_critic and GAEEstimator.turn_reward == "step_reward"
    assert loss_for(AlgoConfig()) is ppo_clip


@pytest.mark.parametrize("key, value, message", [
    ("adv_estimator", "grpo", "algo.adv_estimator: unknown advantage estimator 'grpo'; built-in: gae, return, or "
                              "'package.module:name' for your own"),
    ("adv_estimator", "relayrl.trainer.algo:gae", "algo.adv_estimator: 'relayrl.trainer.algo:gae' is a function, "
                                                  "not a subclass of relayrl.trainer.estimators.AdvantageEstimator"),
    ("policy_loss", "ppo", "algo.policy_loss: unknown policy loss 'ppo'; built-in: ppo_clip"),
    ("policy_loss", "relayrl.trainer.algo:LOG_RATIO_LIMIT", "algo.policy_loss: 'relayrl.trainer.algo:LOG_RATIO_LIMIT' "
                                                           "is a float, not a function"),
])
def test_a_bad_estimator_or_loss_is_one_line_naming_the_key(key, value, message):
    algo = AlgoConfig(**{key: value})
    with pytest.raises(InputError) as e:
        (estimator_for if key == "adv_estimator" else loss_for)(algo)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
