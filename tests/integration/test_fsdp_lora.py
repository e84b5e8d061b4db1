"""LoRA with FSDP2: `train.engine=fsdp train.world_size=2 model.lora_rank=4` shards the peft-wrapped policy over two
gloo ranks, trains only the adapters, relays only them (gathered on rank 0) and exports the merged model; the result
must equal the one-process LoRA run's with the same seed. The one-process run runs here, in this process, while the
two ranks run beside it (what the pair costs is then about the slower run alone)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from bounds import bound
from conftest import TESTS, write_sums

from relayrl.cli import main
from relayrl.common.files import read_jsonl
from relayrl.models import load_model


def args(tiny_path, data, out, name, *extra) -> list[str]:
    return [f"model.path={tiny_path}", "engine.dtype=float32", f"data.train.source={data}", "data.batch_size=2",
            "data.group_size=2", "sampling.max_new_tokens=10", "run.steps=2", f"run.output_dir={out}",
            f"run.name={name}", "train.lr=1e-2", "judge.reward_fn=rewards_for_tests:parity_reward", "judge.workers=1",
            "run.tensorboard=false", "eval.at_start=false", "eval.at_end=false", "train.micro_batch_tokens=16",
            "model.lora_rank=4", "algo.entropy_coef=0.01", "run.print_samples=0", "model.autocast_bf16=false",
            *extra]


def test_two_fsdp_ranks_train_lora_like_one_process(tiny_path, tmp_path, capsys):
    data = write_sums(tmp_path / "d.jsonl", 8)
    env = {**os.environ, "PYTHONPATH": TESTS, "OMP_NUM_THREADS": "1"}
    two = subprocess.Popen([sys.executable, "-m", "relayrl.cli", "train",
                            *args(tiny_path, data, tmp_path, "two", "train.engine=fsdp", "train.world_size=2")],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert main(["train", *args(tiny_path, data, tmp_path, "one")]) == 0, capsys.readouterr().err[-3000:]
        out, err = two.communicate(timeout=bound(300))
    finally:
        two.kill()
    assert two.returncode == 0, out[-2000:] + err[-3000:]
    rows = {n: [r for r in read_jsonl(tmp_path / n / "metrics.jsonl") if "train/loss" in r] for n in ("one", "two")}
    assert [r["step"] for r in rows["two"]] == [1, 2] and "train/dp_imbalance" in rows["two"][0]
    for a, b in zip(rows["one"], rows["two"]):  # same batches, same loss
        assert a["rollout/reward_mean"] == b["rollout/reward_mean"]
        assert a["train/loss"] == pytest.approx(b["train/loss"], abs=1e-5)
    assert rows["two"][1]["train/logprob_diff_engine_max"] < 1e-4  # step 2 sampled by the merged version 1
    m1, m2 = load_model(str(tmp_path / "one" / "model")), load_model(str(tmp_path / "two" / "model"))
    base = dict(load_model(tiny_path).named_parameters())
    moved = set()
    for (n, p1), (_, p2) in zip(m1.named_parameters(), m2.named_parameters()):
        assert torch.allclose(p1, p2, atol=1e-5), n
        if not torch.equal(p2, base[n]):
            moved.add(n)
    assert moved and all(n.endswith("_proj.weight") for n in moved)  # adapted layers only, merged on export
