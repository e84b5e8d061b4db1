"""`launcher=ray` on a real local Ray cluster of 2 CPUs: the same run as a local one, in Ray actors.

Each test runs `relayrl train ... launcher=ray` as a subprocess and compares with the same config run without
Ray: same seed and one torch thread on both sides, so the per-step losses and rewards must be identical, not
just close. The first test's driver starts its own local cluster and shuts it down; the others join one
cluster started once for the module (`ray.address`), which saves a cluster start (~8 s) per test and checks
that each run leaves the cluster usable for the next.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from bounds import bound, run_progressing
from conftest import TESTS, USER_OUTPUTS, default_sigint, tiny_run_args, write_sums
from safetensors.torch import load_file

pytest.importorskip("ray")

ENV = {**os.environ, "PYTHONPATH": TESTS, "HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled"}
RAY = str(Path(sys.executable).with_name("ray"))


def args(tiny_path: str, data: str, out: Path, name: str, **extra) -> list[str]:
    """`relayrl train` of a tiny run (conftest) with an eval set, one torch thread per process, 2 Ray CPUs."""
    # the rollout correction off on every side: "auto" turns it on for launched servers (another program samples),
    # and this compares their runs with a local one whose fp32 engine leaves it off
    over = {"algo.rollout_correction.enabled": False, "data.eval.source": data, "data.group_size": 4,
            "sampling.max_new_tokens": 12, "eval.size": 3,
            "eval.n": 2, "eval.temperature": 1.0, **USER_OUTPUTS, "run.name": name, "run.threads": 1,
            "ray.num_cpus": 2, **extra}
    return [sys.executable, "-m", "relayrl.cli", "train", *tiny_run_args(tiny_path, data, out, **over)]


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    """A relayrl run to its end: it fails when it prints nothing for 180 s (scaled to the load), not when a busy
    machine makes it slow (tests/bounds.py)."""
    proc = run_progressing(cmd, idle=180, env=ENV)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


def steps(run_dir: Path) -> list[tuple[float, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["train/loss"], r["rollout/reward_mean"]) for r in rows if "train/loss" in r]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "model" / "model.safetensors"))


@pytest.fixture(scope="module")
def local_run(tiny_path, tmp_path_factory):
    """The reference: the same tiny run without Ray."""
    out = tmp_path_factory.mktemp("ray-ref")
    data = write_sums(out / "sums.jsonl", 12)
    run(args(tiny_path, data, out, "local"))
    return out, data


@pytest.fixture(scope="module")
def cluster():
    """`ray start --head` with 2 CPUs on a free port: the address the runs join; stopped after the module."""
    from relayrl.common.net import free_port

    port = free_port()
    subprocess.run([RAY, "start", "--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
                    "--disable-usage-stats"], check=True, capture_output=True, env=ENV, timeout=bound(120))
    try:
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([RAY, "stop", "--force"], capture_output=True, env=ENV, timeout=bound(120))


def test_colocated_on_ray_equals_local_run(tiny_path, local_run, cluster):
    """Without ray.address the run starts a private cluster, even with another one running on the machine."""
    out, data = local_run
    proc = run(args(tiny_path, data, out, "ray", launcher="ray"))
    assert "launcher=ray: started a private Ray cluster" in proc.stderr, proc.stderr[-3000:]
    assert "TrainerWorker" in proc.stdout + proc.stderr  # it really ran in an actor (Ray prefixes its lines)
    assert "final eval" in proc.stdout
    assert len(steps(out / "ray")) == 2 and steps(out / "ray") == steps(out / "local")
    ref = weights(out / "local")
    for name, w in weights(out / "ray").items():
        assert torch.equal(w, ref[name]), name


def test_fsdp_ranks_as_ray_actors_equal_local_run(tiny_path, local_run, cluster):
    out, data = local_run
    run(args(tiny_path, data, out, "fsdp", launcher="ray", **{"train.engine": "fsdp", "train.world_size": 2,
                                                              "ray.address": cluster}))
    got, want = steps(out / "fsdp"), steps(out / "local")
    assert len(got) == 2 and [r for _, r in got] == [r for _, r in want]
    assert all(abs(a - b) < 1e-5 for (a, _), (b, _) in zip(got, want))
    ref = weights(out / "local")
    for name, w in weights(out / "fsdp").items():
        assert torch.allclose(w, ref[name], atol=1e-5), name


def test_separate_placement_with_a_launched_server_on_ray(tiny_path, local_run, cluster):
    """Trainer, producer and the producer's inference server: three actors on three bundles of 2 CPUs, weights
    relayed trainer -> producer -> server as versioned safetensors folders."""
    out, data = local_run
    run(args(tiny_path, data, out, "sep", launcher="ray", **{
        "scheduler.mode": "async", "scheduler.placement": "separate", "scheduler.max_staleness": 0,
        "engine.kind": "remote", "engine.launch": "relayrl", "ray.trainer_cpus": 1, "ray.rollout_cpus": 0.5,
        "ray.address": cluster}))
    assert steps(out / "sep") == steps(out / "local")  # max_staleness=0: the synchronous batches, step by step
    assert (out / "sep" / "servers" / "relayrl-0.log").is_file()


def test_separate_placement_dist_transport_on_ray(tiny_path, local_run, cluster):
    """The gloo broadcast trainer -> producer rendezvouses at the node's address (not 127.0.0.1) under Ray."""
    out, data = local_run
    run(args(tiny_path, data, out, "sep-dist", launcher="ray", **{
        "scheduler.mode": "async", "scheduler.placement": "separate", "scheduler.transport": "dist",
        "scheduler.max_staleness": 0, "ray.address": cluster}))
    assert steps(out / "sep-dist") == steps(out / "local")


def test_join_a_running_cluster(tiny_path, local_run, cluster):
    """ray.address: the run joins a cluster started with `ray start --head` and leaves it running, empty."""
    out, data = local_run
    run(args(tiny_path, data, out, "joined", launcher="ray", **{
        "ray.address": cluster, "engine.kind": "remote", "engine.launch": "relayrl"}))
    assert steps(out / "joined") == steps(out / "local")  # a launched relayrl server gives the same run
    deadline = time.monotonic() + 30
    while True:  # the cluster outlives the run, every CPU free again once its actors are gone
        status = subprocess.run([RAY, "status", f"--address={cluster}"], capture_output=True, text=True, env=ENV,
                                timeout=bound(60)).stdout
        if "Active" in status and "0.0/2.0 CPU" in status or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert "Active" in status and "0.0/2.0 CPU" in status, status


def test_not_enough_resources_is_a_clear_error(tiny_path, local_run, cluster):
    out, data = local_run
    proc = subprocess.run(args(tiny_path, data, out, "big", launcher="ray", **{"ray.trainer_cpus": 3,
                                                                               "ray.address": cluster}),
                          capture_output=True, text=True, timeout=bound(120), env=ENV)
    assert proc.returncode != 0
    assert "needs 3 CPU" in proc.stderr and "ray.trainer_" in proc.stderr and "has 2" in proc.stderr


def test_ctrl_c_stops_every_actor_and_server(tiny_path, local_run, cluster):
    out, data = local_run
    seed = 7000 + os.getpid() % 1000  # launched servers carry --seed SEED: how we find leftovers
    proc = subprocess.Popen(args(tiny_path, data, out, "stopped", launcher="ray", **{
        "run.steps": 500, "run.seed": seed, "engine.kind": "remote", "engine.launch": "relayrl",
        "ray.address": cluster}),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, preexec_fn=default_sigint)
    try:
        _wait_for_line(proc, " 1 ", timeout=bound(180))  # the first step's table row
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=bound(60))
        assert time.monotonic() - t0 < bound(45)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    deadline = time.monotonic() + bound(20)
    while _leftovers(seed) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _leftovers(seed)


def _wait_for_line(proc: subprocess.Popen, needle: str, timeout: float) -> None:
    deadline, seen = time.monotonic() + timeout, []
    for line in proc.stdout:
        seen.append(line)
        if "TrainerWorker" in line and needle in line and "%" in line:
            return
        assert time.monotonic() < deadline, "".join(seen[-40:])
    raise AssertionError("the run ended before its first step:\n" + "".join(seen[-40:]))


def _leftovers(seed: int) -> list[str]:
    """Processes still running from the stopped run: its relayrl server, or Ray's workers of that session."""
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout.splitlines()
    return [p for p in out if (f"--seed {seed}" in p and "relayrl.cli serve" in p)
            or p.startswith(("ray::TrainerWorker", "ray::ServerActor"))]
