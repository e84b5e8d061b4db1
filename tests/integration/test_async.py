"""Asynchronous RL on the real tiny model: the staleness bound, sync equivalence at staleness 0, partial
rollout, the decoupled loss by hand, filters, and shutdown."""

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from bounds import bound
from conftest import TESTS, default_sigint, tiny_run_args, write_sums
from engines_for_tests import HaltingEngine
from sandbox_helpers import UNAVAILABLE

from relayrl.common.files import read_jsonl
from relayrl.config.schema import load_run_config
from relayrl.engine.base import SamplingParams
from relayrl.engine.rollout import RolloutController
from relayrl.models import load_model
from relayrl.run.build import build
from relayrl.run.loop import train_steps
from relayrl.tracking.trajectories import load_trajectories
from relayrl.trainer.algo import LossInputs, behav_weights, policy_loss
from relayrl.weights.snapshot import Weights


@pytest.fixture
def data(tmp_path):
    return write_sums(tmp_path / "d.jsonl", 40)


def cfg_for(tiny_path, data, tmp_path, name, **extra):
    more = {"sampling.max_new_tokens": 12, "run.steps": 3, "run.name": name}
    return load_run_config(None, tiny_run_args(tiny_path, data, tmp_path, **{**more, **extra}))


def run(cfg, loop):
    c = build(cfg)
    try:
        loop(c)
    finally:
        c.close()
    return c


@pytest.mark.parametrize("max_staleness, seed", [(0, 1), (1, 2), (1, 3), (2, 4), (3, 5)])
def test_no_trained_sample_exceeds_the_staleness_bound(tiny_path, data, tmp_path, max_staleness, seed):
    """Property over random long-tailed generation lengths (seeded per run)."""
    cfg = cfg_for(tiny_path, data, tmp_path, f"s{max_staleness}-{seed}", **{
        "scheduler.mode": "async", "scheduler.max_staleness": max_staleness, "scheduler.max_concurrency": 6,
        "agent.kind": "agents_for_tests:LongTailAgent", "run.steps": 6, "run.seed": seed,
        "sampling.max_new_tokens": 40})
    c = run(cfg, train_steps)
    recs = load_trajectories(c.run_dir)
    assert len(recs) == 6 * 2 * 2
    for r in recs:  # trained at step k means by the policy of version k - 1
        assert (r["step"] - 1) - r["version_start"] <= max_staleness, r
    rows = [r for r in read_jsonl(c.run_dir / "metrics.jsonl") if "train/loss" in r]
    assert max(r["staleness/max"] for r in rows) <= max_staleness
    if max_staleness >= 1:  # with room to run ahead the producer does so
        assert max(r["staleness/max"] for r in rows) >= 1


def batches(run_dir):
    by_step = {}
    for r in load_trajectories(run_dir):
        by_step.setdefault(r["step"], []).append((r["prompt"], "".join(s["text"] for s in r["segments"]), r["reward"]))
    return {k: sorted(v) for k, v in by_step.items()}


def test_staleness_zero_gives_the_same_batches_as_sync(tiny_path, data, tmp_path):
    sync = run(cfg_for(tiny_path, data, tmp_path, "sync"), train_steps)
    asyn = run(cfg_for(tiny_path, data, tmp_path, "async0", **{"scheduler.mode": "async",
                                                               "scheduler.max_staleness": 0}), train_steps)
    assert batches(sync.run_dir) == batches(asyn.run_dir)
    for (n, a), (_, b) in zip(sync.train_ctl.engine.model.named_parameters(),
                              asyn.train_ctl.engine.model.named_parameters()):
        assert torch.allclose(a, b, atol=1e-5), n


@pytest.mark.parametrize("mode", ["continue", "requeue"])
def test_interrupted_generation_is_resubmitted(tiny_path, mode):
    model = load_model(tiny_path)
    eng = HaltingEngine(model, eos_token_ids=[], max_batch_size=2, halt_at=15)
    ctl = RolloutController([eng], partial_rollout=mode)

    async def go():
        task = asyncio.create_task(ctl.generate([5, 6, 7], SamplingParams(max_new_tokens=60, ignore_eos=True, seed=3),
                                                rid="t"))
        while not eng.halted.is_set():  # 15 tokens generated with version 0
            await asyncio.sleep(0.001)
        ctl.load_weights(Weights(lambda: [(n, p + 0.3 * torch.randn_like(p)) for n, p in model.named_parameters()], 1))
        if mode == "continue":
            eng.abort("t")  # e.g. a remote server dropping requests on a weight update
        eng.resume()
        return await task

    out = asyncio.run(go())
    eng.close()
    assert len(out.output_ids) == len(out.logprobs) == len(out.versions) == 60
    assert out.finish_reason == "length" and ctl.stats["resubmits"] >= 1
    if mode == "continue":
        assert out.versions[0] == 0 and out.versions[-1] == 1  # tokens and logprobs kept across the switch
        switch = out.versions.index(1)
        assert set(out.versions[switch:]) == {1}
    else:
        assert set(out.versions) == {1}  # restarted from scratch under the new weights


def test_decoupled_weights_and_loss_by_hand():
    prox = torch.tensor([-1.0, -1.0, -2.0, -0.5])
    behav = torch.tensor([-1.5, -1.0, -0.2, -0.5])  # log w = 0.5, 0, -1.8, 0
    w, capped = behav_weights(prox, behav, [2, 2], cap=1.5, mode="mask")
    assert w.tolist() == pytest.approx([0.0, 1.0, math.exp(-1.8), 1.0])
    assert capped.tolist() == [True, False, False, False]
    w, _ = behav_weights(prox, behav, [2, 2], cap=1.5, mode="clamp")
    assert w.tolist() == pytest.approx([1.5, 1.0, math.exp(-1.8), 1.0])
    w, _ = behav_weights(prox, behav, [2, 2], cap=None, level="sequence")
    assert w.tolist() == pytest.approx([math.exp(0.25)] * 2 + [math.exp(-0.9)] * 2)
    # loss: -w * min(r A, clip(r) A) with r = exp(logp - prox), here logp = prox + 0.1 (r = e^0.1 in the clip)
    logp = (prox + 0.1).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 1.0, 1.0])
    ww, _ = behav_weights(prox, behav, [2, 2], cap=1.5, mode="clamp")
    loss, stats = policy_loss(logp, None, LossInputs(prox, adv, torch.full((4,), 0.25), 0.25, behav_weight=ww),
                              clip_low=0.2, clip_high=0.2)
    r = math.exp(0.1)
    expected = -(1.5 * r * 1 + 1.0 * r * -1 + math.exp(-1.8) * r * 1 + 1.0 * r * 1) / 4
    assert float(loss.detach()) == pytest.approx(expected, abs=1e-6)


def test_decoupled_training_reports_importance_weights(tiny_path, data, tmp_path):
    c = run(cfg_for(tiny_path, data, tmp_path, "dec", **{"scheduler.mode": "async", "scheduler.max_staleness": 2,
                                                        "algo.decoupled": True, "algo.behav_weight_cap": 2.0}),
            train_steps)
    rows = [r for r in read_jsonl(c.run_dir / "metrics.jsonl") if "train/loss" in r]
    assert all("train/behav_weight_mean" in r and "train/behav_capped_frac" in r for r in rows)
    assert rows[0]["train/behav_weight_mean"] == pytest.approx(1.0, abs=1e-3)  # fp32 engine = trainer at v0


def test_group_filter_keeps_only_mixed_groups_and_the_batch_size(tiny_path, data, tmp_path):
    c = run(cfg_for(tiny_path, data, tmp_path, "filter", **{"scheduler.group_filter": "mixed", "data.group_size": 3}),
            train_steps)
    recs = load_trajectories(c.run_dir)
    by_group = {}
    for r in recs:
        by_group.setdefault((r["step"], r["group_id"]), set()).add(r["reward"])
    assert all(len(v) > 1 for v in by_group.values())
    assert len(recs) == 3 * 2 * 3


def test_over_sampling_keeps_the_first_groups(tiny_path, data, tmp_path):
    c = run(cfg_for(tiny_path, data, tmp_path, "over", **{"scheduler.over_sample": 1.0,
                                                         "agent.kind": "agents_for_tests:LongTailAgent"}),
            train_steps)
    rows = [r for r in read_jsonl(c.run_dir / "metrics.jsonl") if "train/loss" in r]
    assert all(r["rollout/samples"] == 4 for r in rows)
    assert sum(r["rollout/groups_dropped"] for r in rows) >= 3


def test_a_producer_failure_stops_the_run_with_the_real_error(tiny_path, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in __import__("agents_for_tests").failing_prompt_fn_rows()))
    cfg = cfg_for(tiny_path, str(bad), tmp_path, "fail", **{"scheduler.mode": "async", "data.shuffle": False,
                                                           "data.prompt.chat_template": False, "run.steps": 20})
    c = build(cfg)
    c.data.prompt_fn = lambda row, inner=c.data.prompt_fn: inner(row) if row["question"] != "BOOM" else 1 / 0
    t0 = time.perf_counter()
    try:
        with pytest.raises(RuntimeError, match="producer failed") as info:
            train_steps(c)
        assert isinstance(info.value.__cause__, ZeroDivisionError)
    finally:
        c.close()
    assert time.perf_counter() - t0 < bound(30)
    assert not c.env._thread.is_alive() and c.judge.pool.worker_pids() == []


def _ignore_sigint() -> None:
    """Popen preexec_fn: start as a shell's background job does, with SIGINT ignored (Ctrl-C cannot reach it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("placement,sig", [("colocated", signal.SIGINT), ("separate", signal.SIGINT),
                                           ("colocated", signal.SIGTERM)], ids=["colocated", "separate", "sigterm"])
def test_ctrl_c_stops_everything_quickly(tiny_path, data, tmp_path, placement, sig):
    """Ctrl-C (SIGINT), or SIGTERM from a scheduler or `kill` to a run whose SIGINT is ignored, stops the run and
    every process it started within seconds, through the same cleanup, with no traceback."""
    if UNAVAILABLE:  # agent.kind=tool runs the python tool
        pytest.skip(f"the python tool needs an OS sandbox, and none can start here: {UNAVAILABLE}")
    marker = f"relayrl-test-{os.getpid()}-{time.time_ns()}"
    args = [f"{k}={v}" for k, v in {
        "model.path": tiny_path, "engine.dtype": "float32", "data.train.source": data, "data.batch_size": 2,
        "data.group_size": 2, "sampling.max_new_tokens": 200, "run.steps": 10_000, "run.output_dir": str(tmp_path),
        "judge.reward_fn": "rewards_for_tests:parity_reward", "scheduler.mode": "async", "eval.at_start": False,
        "agent.kind": "tool", "scheduler.placement": placement}.items()]
    env = {**os.environ, "PYTHONPATH": TESTS, "RELAYRL_TEST_MARKER": marker}
    proc = subprocess.Popen([sys.executable, "-m", "relayrl.cli", "train", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            preexec_fn=default_sigint if sig == signal.SIGINT else _ignore_sigint)
    deadline = time.monotonic() + bound(120)
    while not list(tmp_path.glob("run/metrics.jsonl")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert list(tmp_path.glob("run/metrics.jsonl")), "training never started"
    proc.send_signal(sig)
    t0 = time.monotonic()
    out, _ = proc.communicate(timeout=bound(30))
    assert time.monotonic() - t0 < bound(15), "shutdown took too long"
    if sig == signal.SIGINT:
        assert proc.returncode == 130 and "interrupted" in out, out[-3000:]
    else:
        assert proc.returncode == 143 and "terminated (SIGTERM)" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")  # whole lines only: nothing cut mid-write
    assert rows and all(isinstance(r, dict) for r in rows)
    time.sleep(0.5)
    assert _processes_with(marker) == [], "processes outlived the run"


def _processes_with(marker: str) -> list[int]:
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if marker.encode() in (d / "environ").read_bytes():
                    found.append(int(d.name))
            except OSError:
                pass
    return found
