"""The Python API: a user's agent and reward, trained without YAML, and the agent contract enforced."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from bounds import bound
from conftest import write_sums

import relayrl
from relayrl import Agent, Sample, Status, evaluate, load_config, train
from relayrl.api import import_path
from relayrl.config import ConfigError

REPO = Path(__file__).resolve().parents[2]


def _tiny(tiny_path, tmp_path, **extra) -> dict:
    data = write_sums(tmp_path / "sums.jsonl", 8)
    return {"model.path": tiny_path, "engine.dtype": "float32", "data.train.source": data, "data.eval.source": data,
            "data.batch_size": 2, "data.group_size": 2, "sampling.max_new_tokens": 6, "eval.size": 2, "eval.n": 1,
            "run.steps": 2, "run.output_dir": str(tmp_path), "judge.workers": 1, "run.print_samples": 0, **extra}


def test_public_names_import_from_the_package_top():
    assert set(relayrl.__all__) >= {"Agent", "Sample", "Status", "load_config", "train", "evaluate"}
    assert Agent.__name__ == "Agent" and Sample and Status


def test_the_python_example_trains_without_yaml(tiny_path, tmp_path):
    over = [f"{k}={v}" for k, v in _tiny(tiny_path, tmp_path, **{"run.steps": 1}).items()]
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "python_api.py"), *over], cwd=tmp_path,
                          capture_output=True, text=True, timeout=bound(300))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = (tmp_path / "python_api").parent.glob("python_api*")
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("train/loss" in m for m in metrics)
    assert "eval/pass@1" in proc.stdout  # train() returned the final evaluation


def test_load_config_takes_a_mapping_and_names_bad_keys():
    cfg = load_config(overrides={"train.lr": 3e-6, "run.name": "123", "data.train.source": "gsm8k:train",
                                 "data.train.kwargs": {"a": 1}})
    assert cfg.train.lr == 3e-6 and cfg.run.name == "123" and cfg.data.train.kwargs == {"a": 1}
    with pytest.raises(ConfigError, match="train.lrr"):
        load_config(overrides={"train.lrr": 1.0})


def local_fn():
    def inner():
        pass
    return inner


def test_objects_must_be_importable_by_name():
    assert import_path(Agent) == "relayrl.agents.base:Agent"
    with pytest.raises(ValueError, match="top level"):
        import_path(local_fn())
    with pytest.raises(ValueError, match="top level"):
        import_path(lambda r, row: 0.0)


class ForgetsStatus(Agent):  # a common mistake: never marks the sample finished
    async def generate_sample(self, sample):
        out = await self.rollout_ctl.generate(sample.prompt_ids, self.params_for(sample))
        sample.append_generated(out.output_ids, out.logprobs, out.versions, out.finish_reason)
        return sample


def test_an_agent_that_leaves_a_sample_unfinished_stops_the_run_naming_it(tiny_path, tmp_path):
    cfg = load_config(overrides=_tiny(tiny_path, tmp_path))
    with pytest.raises(ValueError, match=r"ForgetsStatus.generate_sample returned a sample with status 'init'"):
        train(cfg, agent=ForgetsStatus)


def test_evaluate_with_a_python_reward(tiny_path, tmp_path):
    cfg = load_config(overrides=_tiny(tiny_path, tmp_path))
    metrics = evaluate(cfg, reward=constant_reward)
    assert metrics["eval/reward_mean"] == 0.25


def constant_reward(response: str, row: dict) -> float:
    return 0.25
