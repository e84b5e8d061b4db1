"""Separate placement checkpoints and resumes as a colocated async run does (relayrl.run.producer): `relayrl train`
killed with SIGKILL mid-run, then resumed, trains every drawn prompt once, and each checkpoint counts every prompt
the producer drew as trained or still to generate (the colocated accounting of test_checkpoint.py); the producer
gets its checkpointed state back exactly; the trackers continue the same run."""

import os
import random
import re
import signal
import subprocess
import sys
import time

import torch
from bounds import bound
from conftest import TESTS, tiny_run_args, write_sums
from test_trackers import needs
from transformers import AutoModelForCausalLM

from relayrl.common.files import read_jsonl
from relayrl.config.schema import load_run_config
from relayrl.run import checkpoint
from relayrl.run.build import build
from relayrl.run.loop import train_steps
from relayrl.tracking.trajectories import load_trajectories

NUMBER = re.compile(r"What is (\d+) \+")


def difference(a, b, at: str = "") -> str | None:
    """Where two nested states differ (tensors by value, the rest by ==), or None."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
        return None if same else at
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{at} keys {sorted(a.keys() ^ b.keys())}"
        return next((d for k in a if (d := difference(a[k], b[k], f"{at}.{k}"))), None)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple) and len(a) == len(b):
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := difference(x, y, f"{at}[{i}]"))), None)
    return None if a == b else f"{at}: {a!r} != {b!r}"


def logged_steps(run_dir) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [r["step"] for r in read_jsonl(path) if "train/loss" in r] if path.exists() else []


@needs("mlflow")
def test_kill_9_of_a_separate_async_run_then_resume(tiny_path, tmp_path):
    data = write_sums(tmp_path / "d.jsonl", 40)  # more than 6 steps draw: no epoch wraps, each prompt is drawn once
    args = tiny_run_args(tiny_path, data, tmp_path, **{
        "run.name": "sep", "run.steps": 6, "run.checkpoint_every": 1, "run.keep_checkpoints": 6,
        "run.resume": "auto", "run.trackers": "[jsonl, mlflow]", "scheduler.mode": "async",
        "scheduler.placement": "separate", "scheduler.max_staleness": 1, "data.shuffle": False,
        "agent.kind": "agents_for_tests:LongTailAgent", "sampling.max_new_tokens": 30})
    run_dir = tmp_path / "sep"
    proc = subprocess.Popen([sys.executable, "-m", "relayrl.cli", "train", *args], env={**os.environ,
                            "PYTHONPATH": TESTS}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + bound(120)
    while proc.poll() is None and len(checkpoint.list_checkpoints(run_dir)) < 2:
        assert time.monotonic() < deadline, "no checkpoint came"
        time.sleep(0.005)
    time.sleep(0.3 * random.Random(0).random())  # somewhere in the next step: taking a batch, training, writing
    assert proc.poll() is None, proc.communicate()[0][-3000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    ckpt = checkpoint.latest_checkpoint(run_dir)
    step = int(ckpt.name.split("_")[1])
    assert 2 <= step < 6
    saved = torch.load(ckpt / "data.pt", weights_only=True)

    c = build(load_run_config(None, args), role="trainer")  # the resume: trainer here, producer in its process
    try:
        assert c.run_dir == run_dir and c.step == step and c.train_ctl.version == step
        saved_model = AutoModelForCausalLM.from_pretrained(ckpt / "model")
        for (n, p), (_, q) in zip(saved_model.named_parameters(), c.train_ctl.engine.model.named_parameters()):
            assert torch.equal(p, q), n
        # the producer, before it starts, holds the checkpoint's state (but the data generator: loading the data
        # state makes a new loader iterator, which draws from it; the prompts drawn depend on (seed, epoch) and the
        # loader's position only, relayrl.data.manager)
        loaded = c.rollouts.state_dict()
        loaded["data"]["generator"] = saved["data"]["generator"]
        assert difference(loaded, saved) is None
        train_steps(c)
    finally:
        c.close()

    assert logged_steps(run_dir) == [1, 2, 3, 4, 5, 6]  # the killed attempt's rows after the checkpoint set aside
    recs = load_trajectories(run_dir)
    # after the resume the producer generated with the checkpoint's weights and those trained since, never with
    # weights the killed attempt relayed (a version the resumed trainer had not made yet)
    assert all(step <= r["version_start"] and r["version_end"] < r["step"] for r in recs if r["step"] > step)
    groups = {r["group_id"]: (r["step"], int(NUMBER.search(r["prompt"]).group(1))) for r in recs}
    trained = [n for _, n in groups.values()]
    assert len(trained) == 12 and len(set(trained)) == 12  # no prompt trained twice
    for at, folder in checkpoint.list_checkpoints(run_dir):  # no prompt lost: trained, or still to generate
        state = torch.load(folder / "data.pt", weights_only=True)
        done = [n for s, n in groups.values() if s <= at]
        pending = [int(NUMBER.search(row["question"]).group(1)) for row in state["data"]["requeued"]]
        assert sorted(done + pending) == list(range(state["data"]["loader"]["_num_yielded"])), at
        assert state["async"]["accepted"] == 2 * at
    # the trainer's trackers continue the run the killed attempt began: one mlflow run, each step once (wandb keeps
    # its id in the run folder the same way, MetricsLogger.for_run; test_tracker_conventions.py resumes it)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("relayrl").experiment_id])
    assert run.info.run_id == (run_dir / "mlruns" / "run_id").read_text()
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    # every step, in order; a step the killed attempt logged after its last complete checkpoint comes again from the
    # resumed one (mlflow keeps what reached it; metrics.jsonl, which relayrl owns, holds each step once: above)
    assert sorted(set(steps)) == [1, 2, 3, 4, 5, 6] and steps == sorted(steps)
    assert all(steps.count(n) <= 2 for n in steps)
