"""Checkpoints of LoRA runs sharded with FSDP2 (`train.engine=fsdp model.lora_rank=4`, two gloo ranks): the shards
hold the adapters and their optimizer state only (the frozen base is model.path's), model/ the merged export; a
resume in fresh processes continues as if never stopped (same batches, losses and weights, LoRA dropout included:
every rank's generators are restored), and on one rank it reshards the adapters."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import write_sums
from test_checkpoint import batches, train_rows
from test_fsdp_checkpoint import weights
from test_fsdp_loop import run
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from relayrl.run import checkpoint
from relayrl.trainer.shards import SHARDS

# dropout draws on every rank, so only restored generators replay it; lr 1e-2 moves the adapters far enough that a
# missing Adam state would change step 4's loss and the final weights
LORA = ("model.lora_rank=4", "model.lora_dropout=0.1", "train.lr=1e-2", "algo.entropy_coef=0.01",
        "model.autocast_bf16=false", "run.steps=4", "train.engine=fsdp")


def train(tiny_path, data, out, name, world: int, *extra) -> str:
    done = run(tiny_path, data, out, name, *LORA, f"train.world_size={world}", *extra)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def assert_adapter_shards(step_dir: Path) -> None:
    """The shards hold every adapter and no base weight, with Adam's moments; trainer.pt marks LoRA and holds both
    ranks' generators."""
    dcp_to_torch_save(step_dir / SHARDS, step_dir.parent / "full.pt")
    full = torch.load(step_dir.parent / "full.pt", weights_only=False)
    (step_dir.parent / "full.pt").unlink()
    names = sorted(full["model"])
    assert names and all(n.endswith((".lora_A.default.weight", ".lora_B.default.weight")) for n in names), names
    assert {n.partition(".lora_")[0] for n in names} >= {"base_model.model.model.layers.0.self_attn.q_proj"}
    assert sorted(full["optim"]["state"]) == names
    assert all(full["optim"]["state"][n]["exp_avg"].abs().sum() > 0 for n in names if ".lora_B." in n)
    trainer = torch.load(step_dir / "trainer.pt", weights_only=True)
    assert trainer["lora"] == {} and "policy_optimizer" not in trainer and len(trainer["rank_rng"]) == 2


def resume(tiny_path, data, tmp_path, name: str, world: int) -> str:
    """Resume a copy of the straight run's folder from its step_2 (step_4 deleted) on `world` ranks."""
    shutil.copytree(tmp_path / "straight", tmp_path / name)
    shutil.rmtree(checkpoint.checkpoints_dir(tmp_path / name) / "step_4")
    return train(tiny_path, data, tmp_path, name, world, "run.resume=auto")


def test_lora_fsdp_resume_equals_an_uninterrupted_run(tiny_path, tmp_path):
    data = write_sums(tmp_path / "d.jsonl", 8)
    train(tiny_path, data, tmp_path, "straight", 2, "run.checkpoint_every=2", "run.keep_checkpoints=2")
    root = checkpoint.checkpoints_dir(tmp_path / "straight")
    assert [p.name for _, p in checkpoint.list_checkpoints(tmp_path / "straight")] == ["step_2", "step_4"]
    assert_adapter_shards(root / "step_2")
    # step_4's merged export is the run's final model: the export gathers the adapters and merges them into the base
    final = weights(tmp_path / "straight" / "model")
    for n, p in weights(root / "step_4" / "model").items():
        assert torch.equal(p, final[n]), n

    with ThreadPoolExecutor(2) as pool:  # the two resumes run side by side (most of each is start-up)
        same, other = pool.map(lambda a: resume(tiny_path, data, tmp_path, *a), [("same", 2), ("reshard", 1)])
    assert f"resuming from {checkpoint.checkpoints_dir(tmp_path / 'same') / 'step_2'}" in same
    assert batches(tmp_path / "straight") == batches(tmp_path / "same")
    a, b = train_rows(tmp_path / "straight"), train_rows(tmp_path / "same")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for key in ("train/loss", "train/grad_norm", "train/entropy"):
        assert [r[key] for r in a] == pytest.approx([r[key] for r in b], abs=1e-6), key
    resumed = weights(tmp_path / "same" / "model")
    for n, p in final.items():
        assert torch.allclose(p, resumed[n], atol=1e-6), n

    # one rank: the adapters are resharded; its dropout masks and gradient sums differ from two ranks', but step 3
    # samples from the restored adapters, so its batch is the straight run's
    assert "resharding the trainer from 2 ranks (checkpoint) to 1 (train.world_size)" in other
    assert batches(tmp_path / "reshard")[3] == batches(tmp_path / "straight")[3]
