"""A real run whose rewards are written as TRL writes them: two batched functions with weights, passed to
`relayrl.api.train` as functions, scored by real judge workers while the tiny model trains."""

from pathlib import Path

import pytest
import trl_rewards_for_tests as trl

from relayrl.api import train
from relayrl.common.files import read_jsonl


def test_a_run_trains_on_weighted_trl_rewards_and_logs_each(tiny_run):
    cfg = tiny_run(**{"run.steps": 1, "data.group_size": 4})
    train(cfg, reward=[trl.format_reward, trl.length_reward], reward_weights=[1.0, 0.5])
    metrics = next(Path(cfg.run.output_dir).rglob("metrics.jsonl"))
    step = next(r for r in read_jsonl(metrics) if "train/loss" in r)
    fmt, length = step["rollout/reward/format_reward_mean"], step["rollout/reward/length_reward_mean"]
    assert step["rollout/reward_mean"] == pytest.approx(fmt + 0.5 * length)  # the weighted sum, sample by sample
    assert length > 0 and step["judge/rejected"] == 0 and step["rollout/samples"] == 8
