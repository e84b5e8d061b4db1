"""Separate placement: rollouts in a producer process, weights relayed by disk or torch.distributed.

Real processes throughout (spawned producer, judge workers, gloo over 127.0.0.1): the run trains, the
staleness bound holds across processes, max_staleness=0 reproduces synchronous training batch for batch,
and a producer that fails stops the run with its own traceback."""

from __future__ import annotations

import time

import pytest
import torch
from test_async import batches, cfg_for, data  # noqa: F401 - fixtures

from relayrl.common.files import read_jsonl
from relayrl.run.build import build
from relayrl.run.loop import train_steps
from relayrl.tracking.trajectories import load_trajectories


def run_separate(cfg):
    c = build(cfg, role="trainer")
    try:
        train_steps(c)
    finally:
        c.close()
    return c


@pytest.mark.parametrize("transport", ["disk", "dist"])
def test_max_staleness_zero_matches_sync_across_processes(tiny_path, data, tmp_path, transport):  # noqa: F811
    sync = build(cfg_for(tiny_path, data, tmp_path, "sync"))
    try:
        train_steps(sync)
    finally:
        sync.close()
    sep = run_separate(cfg_for(tiny_path, data, tmp_path, f"sep-{transport}", **{
        "scheduler.mode": "async", "scheduler.placement": "separate", "scheduler.transport": transport,
        "scheduler.max_staleness": 0}))
    assert sep.rollouts.proc.exitcode == 0  # stopped cleanly, not killed
    assert batches(sep.run_dir) == batches(sync.run_dir)  # same prompts, responses and rewards per step
    for (n, a), (_, b) in zip(sync.train_ctl.engine.model.named_parameters(),
                              sep.train_ctl.engine.model.named_parameters()):
        assert torch.allclose(a, b, atol=1e-5), n


def test_separate_staleness_bound_and_versions(tiny_path, data, tmp_path):  # noqa: F811
    cfg = cfg_for(tiny_path, data, tmp_path, "sep-stale", **{
        "scheduler.mode": "async", "scheduler.placement": "separate", "scheduler.max_staleness": 1,
        "agent.kind": "agents_for_tests:LongTailAgent", "run.steps": 5, "sampling.max_new_tokens": 40,
        "eval.at_end": True, "data.eval.source": data, "eval.size": 2, "eval.n": 2})
    c = run_separate(cfg)
    recs = load_trajectories(c.run_dir)
    assert len(recs) == 5 * 2 * 2
    for r in recs:
        assert (r["step"] - 1) - r["version_start"] <= 1, r
    assert max(r["version_end"] for r in recs) >= 3  # the producer's engines got the trained weights
    rows = read_jsonl(c.run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3, 4, 5]
    # the producer's engine counters travel with its groups: its decode steps show in the trainer's metrics
    assert sum(r.get("engine/decode_steps", 0) for r in rows) > 0
    # at most (max_staleness + 1) batches of 2 groups x 2 samples generate at once
    assert all(0 < r["engine/rows_per_step"] <= 8 for r in rows if "engine/rows_per_step" in r)
    # and the rollout side's own: time loading weights, time held by the staleness bound, weights in transit
    steps = [r for r in rows if "train/loss" in r]
    assert sum(r["rollout/weight_load_s"] for r in steps) > 0
    assert all(0.0 <= r["rollout/weight_pause_s"] <= r["rollout/weight_load_s"] for r in steps)
    assert all(r["rollout/weight_stage_s"] >= 0.0 for r in steps)
    assert all(0.0 <= r["rollout/held_frac"] <= 1.0 for r in steps)
    assert all(r["rollout/engine_version_lag"] >= 0 for r in steps)
    assert any("eval/pass@1" in r for r in rows)  # evaluation ran in the producer, logged by the trainer
    assert (c.run_dir / "weights" / "LATEST").read_text().strip() == "5"


def test_a_failing_producer_stops_the_trainer_with_its_traceback(tiny_path, data, tmp_path):  # noqa: F811
    cfg = cfg_for(tiny_path, data, tmp_path, "sep-fail", **{
        "scheduler.mode": "async", "scheduler.placement": "separate",
        "agent.kind": "agents_for_tests:BrokenInitAgent"})
    t0 = time.perf_counter()
    c = build(cfg, role="trainer")
    try:
        with pytest.raises(RuntimeError, match="producer process failed") as info:
            train_steps(c)
        assert "broken agent: bad kwargs" in str(info.value)
    finally:
        c.close()
    assert time.perf_counter() - t0 < 60 and not c.rollouts.proc.is_alive()


def test_the_producer_produces_only_once_the_loop_starts(tiny_path, data, tmp_path):  # noqa: F811
    """The producer process's start-up (its model, engines, judge) is not counted in the first step's time: once
    built it says "ready" and generates nothing until the training loop calls start()."""
    c = build(cfg_for(tiny_path, data, tmp_path, "sep-ready", **{
        "scheduler.mode": "async", "scheduler.placement": "separate"}), role="trainer")
    try:
        handle = c.rollouts
        deadline = time.monotonic() + 120
        while not handle._ready and time.monotonic() < deadline:
            handle._pump(0.5)
        assert handle._ready
        idle_until = time.monotonic() + 3
        while time.monotonic() < idle_until:
            handle._pump(0.2)
        assert not handle._groups  # ready for 3 s, and nothing generated
        handle.start()
        batch, _ = handle.next_batch(0)
        assert batch and all(v == 0 for s in batch for v in s.versions if v >= 0)
    finally:
        c.close()
