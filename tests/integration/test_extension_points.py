"""Extension points as a user meets them: an advantage estimator and a policy loss of the user's own, in a module
of their project, named by import path in the config, train one step of the tiny model; a bad name fails at
start-up in one line naming the key, before any model loads; and the group-size rule asks the estimator."""

import textwrap

import pytest

from relayrl.common.errors import InputError
from relayrl.common.files import read_jsonl
from relayrl.config import ConfigError
from relayrl.run.build import check_user_code
from relayrl.run.loop import train

USER_CODE = '''
import torch

from relayrl.trainer.estimators import AdvantageEstimator, Advantages

CALLS = {"estimator": 0, "loss": 0}


class Constant(AdvantageEstimator):
    """Every trained token gets advantage 0.5, whatever its reward: no group in sight."""

    group_relative = False

    def estimate(self, inputs):
        CALLS["estimator"] += 1
        return Advantages([torch.full((n,), 0.5) for n in inputs.lengths])


def reinforce(logp, entropy, inputs, algo):
    """Plain REINFORCE: -A * log pi per token, weighted so micro-batches add up."""
    CALLS["loss"] += 1
    loss = (inputs.weights * -inputs.advantages * logp).sum()
    return loss, {"loss": float(loss.detach()), "user_adv": float((inputs.weights * inputs.advantages).sum())}
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_algo.py").write_text(textwrap.dedent(USER_CODE))
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_algo

    yield my_algo


def test_a_user_estimator_and_loss_by_import_path_train_one_step(tiny_run, user_module):
    cfg = tiny_run(**{"run.steps": 1, "data.group_size": 1, "algo.adv_estimator": "my_algo:Constant",
                      "algo.policy_loss": "my_algo:reinforce"})
    train(cfg)
    assert user_module.CALLS["estimator"] == 1 and user_module.CALLS["loss"] >= 1
    metrics = next(r for r in read_jsonl(cfg.run_dir / "metrics.jsonl") if "train/loss" in r)
    assert metrics["train/adv_mean"] == pytest.approx(0.5)  # the estimator's advantages, on every token
    assert metrics["train/user_adv"] == pytest.approx(0.5)  # ... reached the user's loss (token-mean weights)
    assert metrics["train/grad_norm"] > 0  # and its gradient the update


@pytest.mark.parametrize("key, value, message", [
    ("algo.adv_estimator", "grpo", "algo.adv_estimator: unknown advantage estimator 'grpo'; built-in: gae, return"),
    ("algo.adv_estimator", "my_algo:Constnt", "algo.adv_estimator: module 'my_algo' has no attribute 'Constnt'"),
    ("algo.policy_loss", "my_algo:Constant.estimate.x", "algo.policy_loss: module 'my_algo' has no attribute"),
    ("algo.policy_loss", "ppo", "algo.policy_loss: unknown policy loss 'ppo'; built-in: ppo_clip"),
    ("agent.kind", "singleturn", "agent.kind: unknown agent 'singleturn'; built-in: env, external"),
    ("judge.reward_fn", "maths", "judge.reward_fn: unknown reward function 'maths'; built-in: llm_judge, math"),
])
def test_an_unknown_name_fails_at_start_up_naming_the_key(tiny_run, user_module, key, value, message):
    with pytest.raises(InputError) as e:
        check_user_code(tiny_run(**{key: value}))
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_the_group_size_rule_asks_the_estimator(tiny_run, user_module):
    with pytest.raises(ConfigError, match=r"^data\.group_size: must be >= 2 for group-relative advantages"):
        check_user_code(tiny_run(**{"data.group_size": 1}))  # grpo: group mean and std
    check_user_code(tiny_run(**{"data.group_size": 1, "algo.preset": "reinforce_pp"}))  # batch-whitened returns
    check_user_code(tiny_run(**{"data.group_size": 1, "algo.adv_estimator": "my_algo:Constant"}))
    check_user_code(tiny_run(**{"judge.reward_fn": "math"}))  # a built-in reward by name
