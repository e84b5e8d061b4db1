"""`relayrl train train.engine=fsdp train.world_size=2`: relayrl starts two trainer processes (torchrun, gloo on
CPU); rank 0 runs the RL loop and the other rank mirrors its trainer calls. The trained model must equal the
one-process run's with the same seed: same batches, and FSDP's summed gradients give the same update."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from bounds import bound
from conftest import TESTS, write_sums

from relayrl.common.files import read_jsonl
from relayrl.models import load_model


def run(tiny_path, data, out, name, *extra) -> subprocess.CompletedProcess:
    args = [f"model.path={tiny_path}", "engine.dtype=float32", f"data.train.source={data}", "data.batch_size=2",
            "data.group_size=2", "sampling.max_new_tokens=10", "run.steps=2", f"run.output_dir={out}",
            f"run.name={name}", "train.lr=1e-3", "judge.reward_fn=rewards_for_tests:parity_reward", "judge.workers=1",
            "run.tensorboard=false", "eval.at_start=false", "eval.at_end=false", "train.micro_batch_tokens=16",
            *extra]
    env = {**os.environ, "PYTHONPATH": TESTS, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "relayrl.cli", "train", *args], env=env, capture_output=True,
                          text=True, timeout=bound(300))


def test_two_fsdp_ranks_train_like_one_process(tiny_path, tmp_path):
    data = write_sums(tmp_path / "d.jsonl", 8)
    one = run(tiny_path, data, tmp_path, "one")
    two = run(tiny_path, data, tmp_path, "two", "train.engine=fsdp", "train.world_size=2")
    assert one.returncode == 0, one.stderr[-3000:]
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-3000:]
    rows = {n: [r for r in read_jsonl(tmp_path / n / "metrics.jsonl") if "train/loss" in r] for n in ("one", "two")}
    assert [r["step"] for r in rows["two"]] == [1, 2]
    for a, b in zip(rows["one"], rows["two"]):  # same batches, same loss
        assert a["rollout/reward_mean"] == b["rollout/reward_mean"]
        assert a["train/loss"] == pytest.approx(b["train/loss"], abs=1e-5)
    assert "train/dp_imbalance" in rows["two"][0]  # the micro-batches were split over two ranks
    m1, m2 = load_model(str(tmp_path / "one" / "model")), load_model(str(tmp_path / "two" / "model"))
    for (n, p1), (_, p2) in zip(m1.named_parameters(), m2.named_parameters()):
        assert torch.allclose(p1, p2, atol=1e-5), n
