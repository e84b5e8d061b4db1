"""Run-level attacks on real tiny runs (issue 58, runs): a second run on a held folder, a reward function that
leaves grandchildren and floods its output, write failures (a file, a read-only and a full file system as
run.output_dir), and a checkpoint whose checksums match but whose content does not load.

`relayrl.cli.main` runs in this process (the command's real error path, without a second torch import); judge
workers, grandchildren and the lock holder are real processes. The read-only and full file systems are real
tmpfs mounts, so those tests need root (or CAP_SYS_ADMIN) and skip without it."""

import contextlib
import json
import os
import subprocess
from pathlib import Path

import orphan_rewards_for_tests as orphans
import pytest
import torch
from bounds import bound
from conftest import run_folder_held_by_another_process, tiny_run_args, write_sums
from safetensors.torch import load_file, save_file

from relayrl.cli import main
from relayrl.common.errors import InputError
from relayrl.config.schema import load_run_config
from relayrl.judge.pool import OUTPUT_LIMIT
from relayrl.run import checkpoint
from relayrl.run.build import build
from relayrl.run.lock import RunLock


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_sums(tmp_path_factory.mktemp("data") / "d.jsonl", 12)


def train_cli(tiny_path, data, out, **extra) -> int:
    return main(["train", *tiny_run_args(tiny_path, data, out, **extra)])


@contextlib.contextmanager
def tmpfs(path: Path, options: str):
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_second_run_on_a_held_folder_stops_naming_the_first_and_moves_nothing(tiny_path, data, tmp_path, capsys):
    run_dir = tmp_path / "t"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("mine")
    with run_folder_held_by_another_process(run_dir) as holder:
        assert train_cli(tiny_path, data, tmp_path, **{"run.resume": "auto"}) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {run_dir} is in use by another run (pid {holder.pid} on host ") and "\n" not in err
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock", "notes.txt"]  # nothing moved to superseded/


def test_a_reward_functions_grandchildren_and_output_end_with_the_run(tiny_path, data, tmp_path, monkeypatch,
                                                                      capfd):
    pid_file = tmp_path / "pids"
    monkeypatch.setenv(orphans.PIDS_ENV, str(pid_file))
    code = train_cli(tiny_path, data, tmp_path, **{"judge.reward_fn": "orphan_rewards_for_tests:orphaning_reward",
                                                   "judge.timeout": 1, "run.steps": 1})
    out, err = capfd.readouterr()
    assert code == 0, err[-2000:]
    pids = [int(p) for p in pid_file.read_text().split()]
    assert len(pids) >= 4  # every call started one; the first hung, timed out, and the run went on
    assert orphans.gone(pids, bound(5.0))  # ...and not one outlived the run
    assert out.count("output of this call cut after") == 1  # 200 kB printed, 16 kB shown
    assert "x" * (OUTPUT_LIMIT // 2) in out and "x" * (OUTPUT_LIMIT + 1) not in out


def test_write_failures_are_one_line_naming_the_path_with_exit_2(tiny_path, data, tmp_path, capsys):
    (tmp_path / "afile").write_text("not a folder")
    assert train_cli(tiny_path, data, tmp_path / "afile") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and str(tmp_path / "afile") in err and "\n" not in err
    assert (tmp_path / "afile").read_text() == "not a folder"

    immutable = tmp_path / "immutable"
    immutable.mkdir()
    if subprocess.run(["chattr", "+i", str(immutable)], capture_output=True).returncode == 0:  # ext4 and root
        try:
            assert train_cli(tiny_path, data, immutable) == 2
        finally:
            subprocess.run(["chattr", "-i", str(immutable)], check=True)
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and str(immutable) in err and "Operation not permitted" in err
        assert "\n" not in err

    with tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        assert train_cli(tiny_path, data, ro) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and str(ro) in err and "Read-only file system" in err and "\n" not in err

    with tmpfs(tmp_path / "full", "size=2m") as full:  # room for step_1's checkpoint (1.4 MB), not for step_2's
        assert train_cli(tiny_path, data, full, **{"run.checkpoint_every": 1}) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        last = err.strip().splitlines()[-1]  # after the run's log lines
        assert last.startswith(f"error: checkpoint of step 2: cannot write {full}/t/checkpoints/step_2: No space left")
        steps = checkpoint.list_checkpoints(full / "t")
        assert [s for s, _ in steps] == [1] and checkpoint.verify(steps[0][1]) is None  # step_1 intact
        assert not list((full / "t" / "checkpoints").glob(".step_*"))  # the half-written one removed


def test_a_checkpoint_that_matches_its_checksums_but_does_not_load_falls_back(tiny_path, data, tmp_path, capsys):
    args = tiny_run_args(tiny_path, data, tmp_path, **{"run.checkpoint_every": 1})
    c = build(load_run_config(None, args))
    try:
        with pytest.raises(InputError, match=f"pid {os.getpid()} "):  # the run holds its folder while it lives
            RunLock.acquire(c.run_dir)
        for step in (1, 2):  # checkpoints as the loop writes them (what is in them is not the point here)
            checkpoint.save(c, step)
    finally:
        c.close()
    RunLock.acquire(c.run_dir).release()  # ...and lets it go at close
    # step_2's weights replaced by a tensor of another shape, its manifest rewritten to match
    step_2 = checkpoint.checkpoints_dir(c.run_dir) / "step_2"
    weights = step_2 / "model" / "model.safetensors"
    tensors = load_file(str(weights))
    name = next(iter(tensors))
    save_file({**tensors, name: torch.zeros(3, 5)}, str(weights), metadata={"format": "pt"})
    manifest = json.loads((step_2 / "manifest.json").read_text())
    manifest["files"]["model/model.safetensors"] = {"size": weights.stat().st_size,
                                                    "sha256": checkpoint.sha256_of(weights)}
    (step_2 / "manifest.json").write_text(json.dumps(manifest))
    assert checkpoint.verify(step_2) is None

    capsys.readouterr()
    again = build(load_run_config(None, [*args, "run.resume=auto"]))  # the resume happens in the build
    again.close()
    assert again.step == 1
    out = capsys.readouterr().out
    assert f"checkpoint {step_2} failed to load (RuntimeError: " in out
    assert [s for s, _ in checkpoint.list_checkpoints(c.run_dir)] == [1]
    assert len(list(step_2.parent.glob("corrupt-step_2-*/model/model.safetensors"))) == 1  # kept, not deleted
