"""GRPO with rollout routing replay on the tiny Qwen3-MoE, as a user runs it: `relayrl train` on
examples/moe_replay.yaml for one step with a checkpoint (the model folder holds the experts in the hub's per-expert
layout, which the resume reads back), then a resume for a second; each step logs the routing metrics."""

from pathlib import Path

from conftest import TINY_RUN, write_sums

from relayrl.cli import main
from relayrl.common.files import read_jsonl
from relayrl.config.schema import load_run_config
from relayrl.run import checkpoint
from relayrl.run.build import build
from relayrl.run.loop import train_steps

EXAMPLE = str(Path(__file__).parents[2] / "examples" / "moe_replay.yaml")


def test_grpo_with_routing_replay_trains_checkpoints_and_resumes(tiny_moe_path, tmp_path):
    data = write_sums(tmp_path / "sums.jsonl", 12)
    # an fp32 engine (the trainer's own model), as every tiny run: the bf16 engine costs seconds on CPUs without native
    # bf16, and the replay's effect is tested exactly in tests/unit/test_moe_replay.py
    keep = {k: v for k, v in TINY_RUN.items() if k not in ("run.steps", "run.name")}
    over = {**keep, "model.path": tiny_moe_path, "data.train.source": data, "data.train.size": "null",
            "data.train.kwargs": "{}", "run.output_dir": str(tmp_path), "run.checkpoint_every": 1}
    args = [f"{k}={v}" for k, v in over.items()]
    assert main(["train", "--config", EXAMPLE, *args, "run.steps=1"]) == 0
    run_dir = tmp_path / "moe_replay"
    assert [p.name for _, p in checkpoint.list_checkpoints(run_dir)] == ["step_1"]
    c = build(load_run_config(EXAMPLE, [*args, "run.steps=2", "run.resume=auto"]))
    try:
        assert c.step == 1 and c.train_ctl.engine.routing_replay
        train_steps(c)
    finally:
        c.close()
    rows = [r for r in read_jsonl(Path(run_dir) / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 0.0 <= r["train/routing_agreement"] <= 1.0
        assert 0 <= r["train/logprob_diff_engine_replay"] < 1e-3 and 0 <= r["train/logprob_diff_engine_noreplay"] < 1e-3
