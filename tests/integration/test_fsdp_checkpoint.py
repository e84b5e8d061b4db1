"""Checkpoints of FSDP-sharded runs (`relayrl train train.engine=fsdp train.world_size=2`, gloo on CPU): every
rank writes its shard, rank 0 the rest and the manifest last; `run.resume=auto` loads the shards on every rank
and continues as if never stopped (same batches, losses and weights), also on another world size (DCP
reshards); incomplete checkpoints are ignored; a checkpoint the configured engine cannot read is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import write_sums
from test_checkpoint import PPO, args_for, batches, train_rows
from test_fsdp_loop import run
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from relayrl.config import ConfigError
from relayrl.config.schema import load_run_config
from relayrl.models import load_model
from relayrl.run import checkpoint
from relayrl.trainer.shards import SHARDS

FSDP2 = ("train.engine=fsdp", "train.world_size=2")
# PPO: the critic and LR schedule (replicated on every rank) are restored beside the sharded policy and optimizer
ALGO = tuple(f"{k}={v}" for k, v in PPO.items())


def train(tiny_path, data, out, name, *extra):
    """A `relayrl train` of the tiny model that must succeed; returns its stdout."""
    done = run(tiny_path, data, out, name, *ALGO, *extra)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return dict(load_model(str(folder)).named_parameters())


def assert_same_run(a: Path, b: Path, atol: float, steps: int = 4) -> None:
    """Same batches, rewards and losses at the first `steps` steps (of 4), and, when all, the same final weights."""
    assert batches(a) == batches(b)
    rows_a, rows_b = train_rows(a)[:steps], train_rows(b)
    assert [r["step"] for r in rows_b] == [1, 2, 3, 4]
    rows_b = rows_b[:steps]
    assert [r["rollout/reward_mean"] for r in rows_a] == [r["rollout/reward_mean"] for r in rows_b]
    for key in ("train/loss", "train/value_loss", "train/grad_norm", "train/lr"):
        assert [r[key] for r in rows_a] == pytest.approx([r[key] for r in rows_b], abs=atol), key
    if steps < 4:
        return
    wa, wb = weights(a / "model"), weights(b / "model")
    for n, p in wa.items():
        assert torch.allclose(p, wb[n], atol=atol), n


def assert_sharded_layout(step_dir: Path, world_size: int) -> None:
    """One DCP file per rank plus its metadata, all in the manifest; the shards hold the exported weights."""
    manifest = json.loads((step_dir / "manifest.json").read_text())
    assert manifest["world_size"] == world_size
    shards = sorted(f for f in manifest["files"] if f.startswith(f"{SHARDS}/"))
    assert shards == [f"{SHARDS}/.metadata", *(f"{SHARDS}/__{r}_0.distcp" for r in range(world_size))]
    assert {"model/model.safetensors", "trainer.pt", "data.pt", "rng.pt", "logs.json"} <= manifest["files"].keys()
    assert "policy_optimizer" not in torch.load(step_dir / "trainer.pt", weights_only=True)  # it is in the shards
    dcp_to_torch_save(step_dir / SHARDS, step_dir.parent / "full.pt")
    full = torch.load(step_dir.parent / "full.pt", weights_only=False)
    (step_dir.parent / "full.pt").unlink()
    for n, p in weights(step_dir / "model").items():
        assert torch.equal(full["model"][n], p), n
        assert n not in full["optim"]["state"] or full["optim"]["state"][n]["exp_avg"].abs().sum() > 0, n


def plant_incomplete(root: Path) -> None:
    """What a kill leaves: a temp folder with shards but no manifest; and a later step_N (a copy of step_2
    renamed step_3) with a shard cut short, so its files no longer match its manifest."""
    shutil.copytree(root / "step_2" / SHARDS, root / ".step_4.tmp-killed" / SHARDS)
    later = root / "step_3"
    shutil.copytree(root / "step_2", later)
    manifest = json.loads((later / "manifest.json").read_text())
    (later / "manifest.json").write_text(json.dumps({**manifest, "step": 3}))
    shard = later / SHARDS / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])


def test_sharded_resume_equals_an_uninterrupted_run(tiny_path, tmp_path):
    """4 steps on 2 ranks vs 2 steps (checkpoint), then resume to 4: on 2 ranks past planted incomplete
    checkpoints, and on 1 rank (resharded) from a copy of the same run folder."""
    data = write_sums(tmp_path / "d.jsonl", 8)
    train(tiny_path, data, tmp_path, "straight", *FSDP2, "run.steps=4")
    train(tiny_path, data, tmp_path, "split", *FSDP2, "run.steps=2", "run.checkpoint_every=2")
    root = checkpoint.checkpoints_dir(tmp_path / "split")
    assert sorted(p.name for p in root.iterdir()) == ["step_2"]  # no temp folder left behind
    assert_sharded_layout(root / "step_2", 2)
    shutil.copytree(tmp_path / "split", tmp_path / "reshard")
    plant_incomplete(root)

    out = train(tiny_path, data, tmp_path, "split", *FSDP2, "run.steps=4", "run.checkpoint_every=2",
                "run.resume=auto")
    assert f"resuming from {root / 'step_2'}" in out
    assert not (root / ".step_4.tmp-killed").exists()
    assert [p.name for _, p in checkpoint.list_checkpoints(tmp_path / "split")] == ["step_2", "step_4"]
    assert_sharded_layout(root / "step_4", 2)
    assert json.loads((root / "step_4" / "manifest.json").read_text())["version"] == 4
    assert_same_run(tmp_path / "straight", tmp_path / "split", atol=1e-6)

    out = train(tiny_path, data, tmp_path, "reshard", "train.engine=fsdp", "train.world_size=1", "run.steps=4",
                "run.resume=auto")
    assert "resharding the trainer from 2 ranks (checkpoint) to 1 (train.world_size)" in out
    # one rank sums the gradients in another order than two: step 3 (the first after the resume, from the restored
    # weights) agrees to float noise; Adam can amplify that noise where gradients are near zero, so step 4 samples
    # from slightly different weights and may draw other tokens (it did when the attention's rounding changed)
    assert_same_run(tmp_path / "straight", tmp_path / "reshard", atol=1e-5, steps=3)


def test_a_checkpoint_the_engine_cannot_read_is_refused(tiny_path, tmp_path):
    """Sharded checkpoints need train.engine=fsdp and one-process ones the local engine: refused before any
    model loads, naming train.engine; under `relayrl train` rank 0's error also stops the other rank."""
    data = write_sums(tmp_path / "d.jsonl", 8)
    for name, world in (("sharded", 2), ("local", None)):
        step = tmp_path / name / "checkpoints" / "step_1"
        step.mkdir(parents=True)
        manifest = {"format": 1, "step": 1, "files": {}} | ({"world_size": world} if world else {})
        (step / "manifest.json").write_text(json.dumps(manifest))
    local = load_run_config(None, args_for(tiny_path, data, tmp_path, "sharded", **{"run.resume": "auto"}))
    with pytest.raises(ConfigError, match=r"train.engine: .*step_1 was written by a sharded trainer \(train.engine="
                                          r"fsdp, world size 2\): resume it with train.engine=fsdp"):
        checkpoint.resume_target(local)
    done = run(tiny_path, data, tmp_path, "local", *FSDP2, "run.resume=auto")
    assert done.returncode != 0
    assert ("config error: train.engine: " f"{tmp_path / 'local' / 'checkpoints' / 'step_1'} was written by one "
            "process (train.engine=local): resume it with train.engine=local") in done.stderr
