"""GRPO on the tiny vision-language model, as a user runs it: `relayrl train` on examples/vlm_squares.yaml over the
generated "how many red squares?" images for one step with a checkpoint, then a resume for a second. The trainer's
logprobs of the engine's tokens match the engine's own (train/mismatch_kl), which holds only when both saw the image;
the step changes the vision tower's weights; the checkpoint's model folder loads whole, processor included."""

import importlib
from pathlib import Path

import torch
from conftest import TINY_RUN
from safetensors.torch import load_file

from relayrl.cli import main
from relayrl.common.files import read_jsonl
from relayrl.config.schema import load_run_config
from relayrl.models.vision import load_processor
from relayrl.run import checkpoint
from relayrl.run.build import build
from relayrl.run.loop import train_steps

REPO = Path(__file__).parents[2]
EXAMPLE = str(REPO / "examples" / "vlm_squares.yaml")


def test_grpo_on_images_trains_checkpoints_and_resumes(tiny_vlm_path, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    data = importlib.import_module("examples.vlm_squares").make_squares(tmp_path / "squares", n=8)
    # the tiny run's parity reward: mixed rewards in every group, so the step trains through the vision tower
    keep = {k: v for k, v in TINY_RUN.items() if k not in ("run.steps", "run.name")}
    over = {**keep, "model.path": tiny_vlm_path, "data.train.source": data, "run.output_dir": str(tmp_path),
            "run.checkpoint_every": 1, "sampling.max_new_tokens": 6}
    args = [f"{k}={v}" for k, v in over.items()]
    assert main(["train", "--config", EXAMPLE, *args, "run.steps=1"]) == 0
    run_dir = tmp_path / "vlm_squares"
    assert [p.name for _, p in checkpoint.list_checkpoints(run_dir)] == ["step_1"]
    saved = run_dir / "checkpoints" / "step_1" / "model"
    assert load_processor(saved).image_seq_len == 16  # the saved model folder carries its image processor
    before, after = (load_file(Path(folder) / "model.safetensors") for folder in (tiny_vlm_path, saved))
    vision = [n for n in before if "vision_model" in n or "connector" in n]
    assert vision and any(not torch.equal(before[n], after[n]) for n in vision)  # the image side trained too
    c = build(load_run_config(EXAMPLE, [*args, "run.steps=2", "run.resume=auto"]))
    try:
        assert c.step == 1
        train_steps(c)
    finally:
        c.close()
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["train/mismatch_kl"] < 1e-6 for r in rows)  # engine and trainer agree: both used the image
