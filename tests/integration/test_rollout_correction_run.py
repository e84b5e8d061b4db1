"""Rollout correction in a real run of the tiny model: on by default for a bf16 engine beside the fp32 trainer
(said in one line at start, recorded in config.yaml), off where both compute in float32; its metrics reach
metrics.jsonl; contradictory or unknown settings stop the CLI with one line naming the key, before any model."""

import pytest
from conftest import tiny_run_args, write_sums

from relayrl.cli import main
from relayrl.common.files import read_jsonl
from relayrl.config.schema import load_run_config
from relayrl.run.resolve import resolve

METRICS = ["train/mismatch_kl", "train/rollout_is_mean", "train/rollout_is_min", "train/rollout_is_max",
           "train/rollout_is_truncated_frac", "train/rollout_is_masked_frac", "train/rollout_is_vetoed_frac"]


def test_a_bf16_engine_run_is_corrected_and_reports_it(tiny_path, tmp_path, capsys):
    data = write_sums(tmp_path / "sums.jsonl", 8)
    assert main(["train", *tiny_run_args(tiny_path, data, tmp_path, **{"engine.dtype": "bfloat16",
                                                                         "run.steps": 1})]) == 0
    out = capsys.readouterr().out
    assert out.count("rollout correction: on (auto: a bfloat16 engine): token ratios truncated at 2, samples "
                     "vetoed below 0.0001") == 1, out[:2000]
    step = next(r for r in read_jsonl(tmp_path / "t" / "metrics.jsonl") if "train/loss" in r)
    assert all(k in step for k in METRICS), sorted(step)
    assert step["train/mismatch_kl"] > 0  # a bf16 engine is not the fp32 trainer's policy
    assert step["train/rollout_is_min"] <= step["train/rollout_is_mean"] <= step["train/rollout_is_max"]
    assert load_run_config(str(tmp_path / "t" / "config.yaml")).algo.rollout_correction.enabled is True


@pytest.mark.parametrize("over, on, why", [
    (["engine.dtype=float32", "model.autocast_bf16=false"], False, "engine and trainer both compute in float32"),
    (["engine.dtype=float32", "model.autocast_bf16=true"], True, "bf16 matmuls in the trainer"),
    (["engine.dtype=float32", "model.autocast_bf16=false", "engine.kv_dtype=bfloat16"], True, "a bfloat16 KV cache"),
    (["engine.dtype=float32", "model.autocast_bf16=false", "engine.kind=remote", "engine.addresses=[http://h:1]"],
     True, "remote servers sample"),
    (["engine.dtype=bfloat16", "algo.rollout_correction.enabled=false"], False, "set in the config"),
])
def test_the_default_follows_the_precisions(over, on, why, capsys):
    cfg = resolve(load_run_config(None, ["data.train.source=rows.jsonl", *over]))
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("rollout correction: "))
    assert cfg.algo.rollout_correction.enabled is on and line.startswith(f"rollout correction: {'on' if on else 'off'}")
    assert why in line


@pytest.mark.parametrize("bad, message", [
    ("algo.rollout_correction.lower=3", "algo.rollout_correction.lower: must be < algo.rollout_correction.upper (2)"),
    ("algo.rollout_correction.upper=-1", "algo.rollout_correction.upper: must be > 0, got -1.0"),
    ("algo.rollout_correction.lower=-0.5", "algo.rollout_correction.lower: must be > 0"),
    ("algo.rollout_correction.veto=1.5", "algo.rollout_correction.veto: must be in (0, 1)"),
    ("algo.rollout_correction.mode=clip", "algo.rollout_correction.mode: expected one of 'truncate', 'mask'"),
    ("algo.rollout_correction.level=geometric", "algo.rollout_correction.level: expected one of 'token'"),
])
def test_bad_settings_are_one_line_naming_the_key(bad, message, tiny_path, tmp_path, capsys):
    data = write_sums(tmp_path / "sums.jsonl", 4)
    assert main(["train", *tiny_run_args(tiny_path, data, tmp_path / "runs"), bad]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "runs").exists()  # refused before a run folder or a model
