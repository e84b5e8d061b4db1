"""A tiny async run with over-sampling, a tail batch and evaluations: the config keys reach the producer, the tail
batch's metrics are logged, and the evaluation's scheduler preempts the producer (relayrl.scheduler)."""

from __future__ import annotations

from conftest import tiny_run_args, write_sums

from relayrl.common.files import read_jsonl
from relayrl.config.schema import load_run_config
from relayrl.run.build import build
from relayrl.run.loop import train_steps


def test_an_async_run_with_over_sampling_and_a_tail_batch(tiny_path, tmp_path):
    cfg = load_run_config(None, tiny_run_args(tiny_path, write_sums(tmp_path / "d.jsonl", 40), tmp_path, **{
        "scheduler.mode": "async", "scheduler.max_staleness": 1, "scheduler.over_sample": 0.5,
        "scheduler.tail_batch_trigger_size": 1, "scheduler.tail_batch_candidate_step": 1, "run.steps": 4,
        "sampling.max_new_tokens": 12, "data.eval.source": write_sums(tmp_path / "e.jsonl", 4), "eval.every": 2,
        "agent.kind": "agents_for_tests:LongTailAgent"}))
    c = build(cfg)
    try:
        assert c.env.scheduler.manager.extra == 1 and c.env.eval_scheduler.preempts is c.env.scheduler
        train_steps(c)
    finally:
        c.close()
    rows = list(read_jsonl(c.run_dir / "metrics.jsonl"))
    steps = [r for r in rows if "train/loss" in r]
    assert len(steps) == 4 and all(r["rollout/samples"] == 4 for r in steps)
    assert all("rollout/tail_set_aside_total" in r and r["staleness/max"] <= 1 for r in steps)
    assert [r["step"] for r in rows if "eval/pass@1" in r] == [2]  # eval.every=2 (TINY_RUN: none at start or end)
