"""One bad sample or input never ends or poisons a run, and nothing a run wrote is lost (issue 14, items 4-5).

Real runs on the tiny model: rejected rewards are counted and left out of training, a lone survivor's group is
dropped, a corrupt checkpoint falls back to the previous one, logs written after a checkpoint are moved aside
(never deleted), a resume with another model is refused, and a failed build leaves no folder behind.
"""

import json
import shutil
from pathlib import Path

import pytest
from test_checkpoint import args_for, train_rows

from relayrl.common.files import read_jsonl
from relayrl.config import ConfigError
from relayrl.config.schema import load_run_config
from relayrl.judge import WorkerCrashed
from relayrl.run import checkpoint
from relayrl.run.build import build
from relayrl.run.loop import train_steps
from relayrl.tracking.trajectories import load_trajectories

TAGS = {0: " NAN", 1: " HUGE", 3: " SOLO"}


@pytest.fixture
def tagged(tmp_path):
    """Rows 0 (reward NaN), 1 (reward 1e9) and 3 (the agent's own NaN on all but one sample) misbehave."""
    path = tmp_path / "tagged.jsonl"
    path.write_text("".join(json.dumps({"question": f"What is {i} + {i}?{TAGS.get(i, '')}", "answer": str(2 * i)})
                            + "\n" for i in range(12)))
    return str(path)


def run(cfg):
    c = build(cfg)
    try:
        train_steps(c)
    finally:
        c.close()
    return c


def tagged_args(tiny_path, data, tmp_path, **extra):
    return args_for(tiny_path, data, tmp_path, "tagged", **{
        "data.batch_size": 3, "data.shuffle": False, "algo.preset": "rloo", "run.steps": 2,
        "judge.reward_fn": "rewards_for_tests:tagged_reward", "agent.kind": "agents_for_tests:SoloAgent",
        "run.checkpoint_every": 1, "run.keep_checkpoints": 2, **extra})


def test_bad_rewards_are_rejected_counted_and_a_corrupt_checkpoint_falls_back(tiny_path, tagged, tmp_path, capsys):
    c = run(load_run_config(None, tagged_args(tiny_path, tagged, tmp_path)))
    first, second = train_rows(c.run_dir)
    # step 1: rows 0 and 1 rejected whole (NaN, 1e9) and replaced by rows 3 and 4; row 3 keeps one sample
    assert (first["judge/rejected_nonfinite"], first["judge/rejected_out_of_range"]) == (3.0, 2.0)
    assert first["judge/rejected"] == 5.0 and first["rollout/groups_filtered"] == 2.0
    assert (first["train/groups_dropped_small"], first["train/samples_dropped_small"]) == (1.0, 1.0)
    assert first["train/samples"] == 4.0 and first["rollout/reward_mean"] <= 1.0
    assert second["judge/rejected"] == 0.0 and second["train/samples"] == 6.0
    assert all(abs(r["train/loss"]) < 1e3 for r in (first, second))
    prompts = {r["prompt"] for r in load_trajectories(c.run_dir)}
    assert not any(t in p for p in prompts for t in ("NAN", "HUGE"))  # never trained, never logged as trained

    # damage step_2 after it was written (same size, one byte changed): the resume falls back to step_1
    root = checkpoint.checkpoints_dir(c.run_dir)
    blob = bytearray((root / "step_2" / "trainer.pt").read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (root / "step_2" / "trainer.pt").write_bytes(bytes(blob))
    capsys.readouterr()
    again = run(load_run_config(None, tagged_args(tiny_path, tagged, tmp_path, **{"run.steps": 3,
                                                                                   "run.resume": "auto"})))
    out = capsys.readouterr().out
    assert again.step == 1 and "step_2 is corrupt (trainer.pt does not match the sha256" in out
    assert [p.name for _, p in checkpoint.list_checkpoints(c.run_dir)] == ["step_2", "step_3"]
    assert len(list(root.glob("corrupt-step_2-*/trainer.pt"))) == 1  # kept for inspection, not deleted
    # nothing lost: the superseded step 2 lines moved aside whole, the live log has each step once
    rows = train_rows(c.run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[0] == first
    side = c.run_dir / "superseded" / "1-after-step_1"
    assert read_jsonl(side / "metrics.jsonl") == [second]
    moved = [r for f in side.glob("trajectories/*/monitor.jsonl") for r in read_jsonl(f)]
    assert len(moved) == 6 and {r["step"] for r in moved} == {2}
    assert rows[1]["train/loss"] == pytest.approx(second["train/loss"], abs=1e-6)  # the same step 2 again


def test_resume_with_another_model_is_refused_naming_both(tiny_path, tagged, tmp_path):
    ckpt = tmp_path / "run" / "checkpoints" / "step_1"
    (ckpt / "model").mkdir(parents=True)
    (ckpt / "config.yaml").write_text(f"model:\n  path: {tiny_path}\n")
    other = shutil.copytree(tiny_path, tmp_path / "other-model")
    cfg = load_run_config(None, args_for(tiny_path, tagged, tmp_path, "x", **{"model.path": other}))
    with pytest.raises(ConfigError, match=rf"model.path: .*step_1 was trained from model '{tiny_path}', not "
                                          rf"'{other}': resume with model.path={tiny_path}"):
        checkpoint.check_model(cfg, ckpt)
    checkpoint.check_model(load_run_config(None, args_for(tiny_path, tagged, tmp_path, "x")), ckpt)  # same: fine
    # the model folder moved (the recorded path is gone) but it is the same architecture: allowed
    (ckpt / "config.yaml").write_text(f"model:\n  path: {tmp_path / 'moved-away'}\n")
    shutil.copy(Path(tiny_path) / "config.json", ckpt / "model" / "config.json")
    checkpoint.check_model(cfg, ckpt)


def test_auto_resume_without_a_checkpoint_moves_the_earlier_attempt_aside(tiny_path, tagged, tmp_path):
    """run.resume=auto on a folder with logs (and even a saved model) but no checkpoint starts at step 0
    there and deletes nothing: the earlier files move to superseded/1-after-step_0/, byte for byte."""
    run_dir = tmp_path / "again"
    files = {"metrics.jsonl": '{"step": 1, "train/loss": 0.5}\n{"step": 2, "tr', "config.yaml": "run: {}\n",
             "trajectories/0/monitor.jsonl": '{"step": 1}\n', "model/config.json": "{}"}
    for rel, text in files.items():
        (run_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / rel).write_text(text)
    (run_dir / "checkpoints" / ".step_1.tmp-x").mkdir(parents=True)  # a killed checkpoint write: not complete
    cfg = load_run_config(None, args_for(tiny_path, tagged, tmp_path, "again", **{"run.resume": "auto"}))
    found, ckpt = checkpoint.resume_target(cfg)
    assert (found, ckpt) == (run_dir, None)
    checkpoint.prepare_resume(found, ckpt)
    side = run_dir / "superseded" / "1-after-step_0"
    assert {rel: (side / rel).read_text() for rel in files} == files
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints", "superseded"]


def test_a_failed_build_leaves_no_folder(tiny_path, tagged, tmp_path):
    """A reward module that fails only in the judge workers is found after the models load and the run folder
    exists: the build fails, and the folder (with the output folder this build created) is removed again."""
    out = tmp_path / "fresh" / "runs"
    args = args_for(tiny_path, tagged, out, "bad", **{"judge.reward_fn": "worker_refusing_reward:reward"})
    with pytest.raises(WorkerCrashed, match="refuses to load in a worker process"):
        build(load_run_config(None, args))
    assert not (tmp_path / "fresh").exists()
    (tmp_path / "mine" / "run").mkdir(parents=True)  # an empty folder the user made is emptied, not removed
    with pytest.raises(WorkerCrashed):
        build(load_run_config(None, args_for(tiny_path, tagged, tmp_path / "mine", "run", **{
            "judge.reward_fn": "worker_refusing_reward:reward"})))
    assert (tmp_path / "mine" / "run").is_dir() and not any((tmp_path / "mine" / "run").iterdir())
