"""Checkpoints and exact resume on the real tiny model: same batches and weights as an uninterrupted run,
rotation, incomplete checkpoints ignored, write failures named, and kill -9 at random moments."""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from bounds import bound
from conftest import TESTS, tiny_run_args, write_sums
from transformers import AutoModelForCausalLM

from relayrl.common.files import read_jsonl
from relayrl.config import ConfigError
from relayrl.config.schema import load_run_config
from relayrl.data import DataManager
from relayrl.run import checkpoint
from relayrl.run.build import build
from relayrl.run.loop import train_steps
from relayrl.tracking.trajectories import load_trajectories


@pytest.fixture
def data(tmp_path):
    return write_sums(tmp_path / "d.jsonl", 12)


def args_for(tiny_path, data, tmp_path, name, **extra):
    return tiny_run_args(tiny_path, data, tmp_path, **{"run.steps": 4, "run.name": name, **extra})


def run(tiny_path, data, tmp_path, name, loop=train_steps, **extra):
    c = build(load_run_config(None, args_for(tiny_path, data, tmp_path, name, **extra)))
    try:
        loop(c)
    finally:
        c.close()
    return c


def batches(run_dir):
    by_step = {}
    for r in load_trajectories(run_dir):
        by_step.setdefault(r["step"], []).append((r["prompt"], "".join(s["text"] for s in r["segments"]), r["reward"]))
    return {k: sorted(v) for k, v in by_step.items()}


def train_rows(run_dir):
    return [r for r in read_jsonl(Path(run_dir) / "metrics.jsonl") if "train/loss" in r]


# PPO: critic, KL reference, LR schedule with warmup (total_steps fixed: it defaults to run.steps, which the
# first half changes), and the preset's two minibatches (the split follows the groups' draw order).
PPO = {"algo.preset": "ppo", "algo.kl_coef": 0.01, "train.lr_schedule": "cosine",
       "train.total_steps": 4, "train.warmup_steps": 1}


# LoRA: the checkpoint's model/ is the merged export; the adapters and their optimizer state are in trainer.pt
LORA = {"model.lora_rank": 4, "algo.kl_coef": 0.01}


# bf16 AdamW moments: saved and restored as bf16, the stochastic rounding replays (relayrl.trainer.optim)
BF16_MOMENTS = {"train.optimizer_state_dtype": "bfloat16"}


# bf16 weights on a bf16 engine (one shared model): each update's stochastic rounding replays too. The rollout
# correction is pinned off: with it on ("auto" here) this resume is not exact yet -- a known bug, not understood
BF16_WEIGHTS = {"model.train_dtype": "bfloat16", "engine.dtype": "bfloat16", "algo.rollout_correction.enabled": False}


@pytest.mark.parametrize("algo", [{}, PPO, LORA, BF16_MOMENTS, BF16_WEIGHTS],
                         ids=["grpo", "ppo", "lora", "bf16_moments", "bf16_weights"])
def test_resume_gives_the_same_batches_and_weights(tiny_path, data, tmp_path, algo):
    """4 steps straight vs 2 steps, then a new build resuming for 2 more (first checkpoint rotated away)."""
    straight = run(tiny_path, data, tmp_path, "straight", **algo)
    first = run(tiny_path, data, tmp_path, "split", **algo, **{"run.steps": 2, "run.checkpoint_every": 1,
                                                               "run.keep_checkpoints": 1})
    assert [p.name for _, p in checkpoint.list_checkpoints(first.run_dir)] == ["step_2"]
    resumed = run(tiny_path, data, tmp_path, "split", **algo, **{"run.resume": "auto"})
    assert resumed.run_dir == first.run_dir and resumed.step == 2  # the same folder, not split-2
    assert resumed.rollout_ctl.version == resumed.train_ctl.version == 4
    assert batches(straight.run_dir) == batches(resumed.run_dir)
    a, b = train_rows(straight.run_dir), train_rows(resumed.run_dir)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert [r["train/loss"] for r in a] == pytest.approx([r["train/loss"] for r in b], abs=1e-6)
    models = [(straight.train_ctl.engine.model, resumed.train_ctl.engine.model)]
    if algo is PPO:
        models.append((straight.train_ctl.critic.model, resumed.train_ctl.critic.model))
        assert resumed.train_ctl.schedule.step_count == 4
    if algo is BF16_MOMENTS or algo is BF16_WEIGHTS:
        states = resumed.train_ctl.engine.optimizer.state.values()
        assert {s["exp_avg_sq"].dtype for s in states} == {torch.bfloat16}
    if algo is BF16_WEIGHTS:
        assert {p.dtype for p in resumed.train_ctl.engine.model.parameters()} == {torch.bfloat16}
        assert resumed.rollout_ctl.engines[0].model is resumed.train_ctl.engine.model  # one model
    for a_model, b_model in models:
        for (n, p), (_, q) in zip(a_model.named_parameters(), b_model.named_parameters()):
            assert torch.allclose(p, q, atol=1e-6), n


def test_rotation_incomplete_checkpoints_and_write_failures(tiny_path, data, tmp_path, monkeypatch):
    c = run(tiny_path, data, tmp_path, "rot", **{"run.steps": 3, "run.checkpoint_every": 1,
                                                 "run.keep_checkpoints": 2})
    root = checkpoint.checkpoints_dir(c.run_dir)
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_3"]  # K kept, no temp folders left
    exported = AutoModelForCausalLM.from_pretrained(root / "step_3" / "model")  # a plain HF folder
    for (n, p), (_, q) in zip(exported.named_parameters(), c.train_ctl.engine.model.named_parameters()):
        assert torch.equal(p, q), n
    # a write that fails names the path and leaves nothing that looks like a checkpoint
    monkeypatch.setattr(checkpoint.torch, "save", lambda *a, **k: (_ for _ in ()).throw(
        OSError(28, "No space left on device")))
    with pytest.raises(OSError, match=r"checkpoint of step 9: cannot write .*rot/checkpoints/\.step_9\.tmp-.*"
                                      r"No space left on device"):
        checkpoint.save(c, 9)
    monkeypatch.undo()
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_3"]
    # incomplete: step_3 without its manifest, a killed build's temp folder, a later step_N with a bad file
    (root / "step_3" / "manifest.json").unlink()
    (root / ".step_4.tmp-x").mkdir()
    (root / ".step_4.tmp-x" / "manifest.json").write_text('{"format": 1, "step": 4, "files": {}}')
    bad = root / "step_5"
    (bad / "model").mkdir(parents=True)
    (bad / "manifest.json").write_text(json.dumps({"format": 1, "step": 5, "files": {"trainer.pt": 10}}))
    (bad / "trainer.pt").write_bytes(b"short")
    assert checkpoint.latest_checkpoint(c.run_dir) == root / "step_2"
    with (c.run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "train/lo')  # a line torn by a crash
    again = run(tiny_path, data, tmp_path, "rot", **{"run.steps": 3, "run.resume": "auto"})
    assert again.step == 2 and [r["step"] for r in train_rows(c.run_dir)] == [1, 2, 3]
    assert sorted(r["step"] for r in load_trajectories(c.run_dir)) == [1] * 4 + [2] * 4 + [3] * 4
    assert not (root / ".step_4.tmp-x").exists()


def test_async_checkpoint_requeues_what_was_not_trained(tiny_path, data, tmp_path):
    """At each checkpoint, every prompt the loader handed out is either trained or saved to be generated
    again, exactly once (the producer had groups in flight and in the buffer)."""
    c = run(tiny_path, data, tmp_path, "async", loop=train_steps, **{
        "scheduler.mode": "async", "scheduler.max_staleness": 1, "run.steps": 2, "run.checkpoint_every": 1,
        "data.shuffle": False, "agent.kind": "agents_for_tests:LongTailAgent", "sampling.max_new_tokens": 30})
    number = re.compile(r"What is (\d+) \+")
    for step, folder in checkpoint.list_checkpoints(c.run_dir):
        state = torch.load(folder / "data.pt", weights_only=True)
        trained = {int(number.search(r["prompt"]).group(1)) for r in load_trajectories(c.run_dir) if r["step"] <= step}
        pending = [int(number.search(row["question"]).group(1)) for row in state["data"]["requeued"]]
        assert sorted([*trained, *pending]) == list(range(state["data"]["loader"]["_num_yielded"])), step
        assert len(trained) == 2 * step and state["async"]["accepted"] == 2 * step


def test_data_state_round_trips_with_requeued_prompts():
    rows = [{"q": i} for i in range(5)]

    def make():
        return DataManager(rows, lambda r: [1], group_size=2, shuffle=True, seed=3)

    ref = make()
    ref.sample_from_dataset()
    ref.requeue({"q": "again"})
    state = ref.state_dict()
    expected = [(g[0].data["q"], g[0].seed) for g in (ref.sample_from_dataset() for _ in range(12))]
    other = make()
    other.load_state_dict(state)
    assert [(g[0].data["q"], g[0].seed) for g in (other.sample_from_dataset() for _ in range(12))] == expected


@pytest.mark.parametrize("bad, message", [
    ({"run.checkpoint_every": -1}, "run.checkpoint_every: must be >= 0"),
    ({"run.keep_checkpoints": 0}, "run.keep_checkpoints: must be >= 1"),
    ({"run.resume": "/nonexistent/run"}, "run.resume: '/nonexistent/run' is not a folder"),
])
def test_checkpoint_config_errors_name_the_key(tiny_path, data, tmp_path, bad, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config(None, args_for(tiny_path, data, tmp_path, "x", **bad))


def test_resume_errors_name_the_key(tiny_path, data, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    cfg = load_run_config(None, args_for(tiny_path, data, tmp_path, "x", **{"run.resume": str(empty)}))
    with pytest.raises(ConfigError, match="run.resume: no complete checkpoint in"):
        build(cfg)
    with pytest.raises(OSError, match=r"run.checkpoint_every: .* MiB free; a checkpoint needs about"):
        checkpoint.check_space(tmp_path, 2**62)


def test_kill_9_at_random_moments_then_resume(tiny_path, tmp_path):
    """SIGKILL `relayrl train` at seeded random moments (after a random number of steps, plus a random part
    of a step), resume each time: one epoch of 24 prompts is trained exactly once, the steps have no gaps or
    duplicates, and the last checkpoint loads and equals an uninterrupted run's weights."""
    data = write_sums(tmp_path / "d.jsonl", 24)
    rng = random.Random(0)
    args = args_for(tiny_path, data, tmp_path, "kill", **{"run.steps": 12, "run.checkpoint_every": 1,
                                                               "run.keep_checkpoints": 2, "run.resume": "auto"})
    env = {**os.environ, "PYTHONPATH": TESTS}
    run_dir = tmp_path / "kill"
    killed_at = []  # (steps logged, checkpoint folder contents) at each kill
    for attempt in range(4):
        last = checkpoint.latest_checkpoint(run_dir)
        resumed_from = int(last.name.split("_")[1]) if last else 0
        stale = _logged_steps(run_dir) > resumed_from  # rows of the killed attempt, until the resume cuts them
        proc = subprocess.Popen([sys.executable, "-m", "relayrl.cli", "train", *args], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if attempt < 3:
            target = min(11, resumed_from + rng.randint(1, 3))
            deadline = time.monotonic() + 120
            while proc.poll() is None and (stale or _logged_steps(run_dir) < target):
                stale = stale and _logged_steps(run_dir) > resumed_from
                assert time.monotonic() < deadline, "training never started"
                time.sleep(0.001)
            time.sleep(0.04 * rng.random())  # anywhere in the next step: rollout, training, checkpoint write
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                killed_at.append((_logged_steps(run_dir), sorted(p.name for p in checkpoint.checkpoints_dir(run_dir)
                                                                 .iterdir())))
        out, _ = proc.communicate(timeout=bound(300))
        assert proc.returncode in (0, -signal.SIGKILL), out[-3000:]
    assert proc.returncode == 0, out[-3000:]
    assert len(killed_at) >= 2, f"the run outran the kills: {killed_at}"
    assert [r["step"] for r in train_rows(run_dir)] == list(range(1, 13))
    recs = load_trajectories(run_dir)
    assert sorted(r["step"] for r in recs) == sorted(list(range(1, 13)) * 4)
    step_of = {}
    for r in recs:
        step_of.setdefault(r["prompt"], set()).add(r["step"])
    assert len(step_of) == 24 and all(len(steps) == 1 for steps in step_of.values())  # each prompt once
    last = checkpoint.latest_checkpoint(run_dir)
    assert last.name == "step_12" and json.loads((last / "manifest.json").read_text())["version"] == 12
    exported = AutoModelForCausalLM.from_pretrained(last / "model")
    # and it is the run that was never interrupted: same batches, same weights
    straight = run(tiny_path, str(data), tmp_path, "straight", **{"run.steps": 12})
    assert batches(straight.run_dir) == batches(run_dir)
    for (n, p), (_, q) in zip(straight.train_ctl.engine.model.named_parameters(), exported.named_parameters()):
        assert torch.allclose(p, q, atol=1e-5), n


def _logged_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return path.read_text().count("train/loss") if path.exists() else 0
