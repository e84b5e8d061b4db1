"""Run-level limits (issue 58, runs): YAML aliases and JSON nesting are bounded, run names are plain names, one
run per folder (an flock), and judge workers are killed with everything they started, printing a bounded amount.

Real parts throughout: the config loader on files, the dataset reader on files, the lock across real processes,
TimeoutPool's real worker processes and the grandchildren they start."""

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import orphan_rewards_for_tests as orphans
import pytest
from bounds import bound
from conftest import run_folder_held_by_another_process

from relayrl.cli import main
from relayrl.common.errors import InputError
from relayrl.config import ConfigError
from relayrl.config.loader import MAX_ALIASES, MAX_DEPTH, read_yaml
from relayrl.config.schema import load_run_config
from relayrl.data.datasets import MAX_JSON_DEPTH, _read_file
from relayrl.judge import TimeoutPool
from relayrl.judge.math import math_reward
from relayrl.judge.pool import OUTPUT_LIMIT
from relayrl.run.lock import LOCK_FILE, RunLock

TESTS_DIR = str(Path(__file__).resolve().parent.parent)


def alias_bomb(levels: int, width: int = 9) -> str:
    """'Billion laughs' under judge.kwargs: each level lists the previous one `width` times."""
    lines = ["judge:", "  kwargs:", "    a0: &a0 [" + ", ".join(["lol"] * width) + "]"]
    lines += [f"    a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


# ---- YAML ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "message"), [
    (alias_bomb(9), "aliases expand to more than 1,000,000"),  # ~650 bytes; 9**10 values expanded
    (alias_bomb(5), "aliases expand to more than 1,000,000"),  # what printed 19.7 MB
    ("judge:\n  kwargs:\n    a: &a [1]\n" + "".join(f"    b{i}: *a\n" for i in range(MAX_ALIASES + 1)),
     f"more than {MAX_ALIASES} aliases"),
    ("judge:\n  kwargs: &k {x: *k}\n", "an alias refers to a value that contains it"),
    ("judge:\n  kwargs: &k [*k]\n", "an alias refers to a value that contains it"),
    ("judge:\n  kwargs: &k {<<: *k}\n", "an alias refers to a value that contains it"),
    ("judge:\n  kwargs:\n    x: " + "[" * 5000 + "]" * 5000 + "\n", f"nested more than {MAX_DEPTH} levels deep"),
    ("judge:\n  kwargs:\n    a: &a " + "[" * 40 + "]" * 40 + "\n    b: " + "[" * 30 + "*a" + "]" * 30 + "\n",
     f"aliases nest more than {MAX_DEPTH} levels deep"),
])
def test_yaml_aliases_and_nesting_are_bounded_with_one_line_naming_the_file(tmp_path, text, message):
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    start = time.perf_counter()
    with pytest.raises(ConfigError) as info:
        load_run_config(str(path), [])
    assert time.perf_counter() - start < bound(1.0)
    assert str(info.value).startswith(f"{path}: invalid YAML: line ") and message in str(info.value)


def test_print_config_of_an_alias_bomb_is_one_line_and_exit_2(tmp_path, capsys):
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb(9))
    assert main(["train", f"--config={path}", "--print-config"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"config error: {path}: invalid YAML: line ") and err.count("\n") == 1
    assert "an alias bomb?" in err


def test_yaml_bounds_leave_ordinary_anchors_and_merges_alone(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("base: &b {top_p: 0.9}\nsampling:\n  <<: *b\n  temperature: 0.7\njudge:\n  kwargs:\n"
                    "    a: &a [1, 2]\n    b: [*a, *a]\n")
    data = read_yaml(str(path))
    assert data["sampling"] == {"top_p": 0.9, "temperature": 0.7} and data["judge"]["kwargs"]["b"] == [[1, 2]] * 2
    with pytest.raises(ConfigError, match="aliases expand to more than"):  # an override's value is YAML too
        load_run_config(None, ["judge.kwargs=" + "{a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol], "
                               + ", ".join(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 8))
                               + "}"])


# ---- JSON datasets -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 100_000])
@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_json_rows_nested_too_deep_are_an_input_error_naming_the_row(tmp_path, depth, suffix):
    good = '{"question": "What is 1 + 1?", "answer": "2"}'
    deep = '{"question": "q", "answer": "1", "x": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"
    path = tmp_path / f"d{suffix}"
    path.write_text(f"{good}\n{deep}\n" if suffix == ".jsonl" else f"[{good},\n{deep}]\n")
    with pytest.raises(InputError, match=f"nested more than {MAX_JSON_DEPTH} levels deep") as info:
        _read_file(path)
    assert str(info.value).startswith(str(path))
    shallow = '{"question": "q", "answer": "1", "x": ' + "[" * 10 + "]" * 10 + "}"
    path.write_text(f"{good}\n{shallow}\n" if suffix == ".jsonl" else f"[{good},\n{shallow}]\n")
    assert len(_read_file(path)) == 2


# ---- gold answers ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("gold", ["???", "-"])
def test_a_gold_answer_math_verify_cannot_parse_is_a_judge_error_not_a_zero(gold):
    with pytest.raises(ValueError, match="cannot parse the gold answer"):  # the judge rejects and counts it
        math_reward("\\boxed{42}", {"answer": gold})
    assert math_reward("\\boxed{42}", {"answer": "42"})["correct"] == 1.0


# ---- run names -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["", ".", "..", "../escaped", "/tmp/abs", "a/b", "a\\b"])
def test_run_name_must_be_a_plain_folder_name(name):
    with pytest.raises(ConfigError, match=r"run\.name: must be a plain folder name"):
        load_run_config(None, [f"run.name={name!r}"])
    assert load_run_config(None, ["run.name=my-run.v2"]).run_dir.name == "my-run.v2"


# ---- one run per folder ----------------------------------------------------------------------------------
def test_a_held_run_folder_refuses_a_second_run_naming_the_holder_and_a_dead_holder_blocks_nothing(tmp_path):
    with run_folder_held_by_another_process(tmp_path) as holder:
        with pytest.raises(InputError) as info:
            RunLock.acquire(tmp_path)
        assert f"{tmp_path} is in use by another run (pid {holder.pid} on host {os.uname().nodename}, started " \
               in str(info.value)
    lock = RunLock.acquire(tmp_path)  # the kernel dropped the dead holder's lock; its file is still there
    assert (tmp_path / LOCK_FILE).is_file()
    with pytest.raises(InputError, match=f"pid {os.getpid()} "):  # one lock per folder within a process too
        RunLock.acquire(tmp_path)
    lock.release()
    RunLock.acquire(tmp_path).release()


# ---- judge workers: process groups and output -----------------------------------------------------------------
def _pids(path: Path, n: int) -> list[int]:
    deadline = time.monotonic() + bound(10.0)
    while time.monotonic() < deadline:
        pids = [int(p) for p in path.read_text().split()] if path.exists() else []
        if len(pids) >= n:
            return pids
        time.sleep(0.05)
    raise AssertionError(f"{n} grandchildren never started")


def _gone(pids: list[int]) -> bool:
    return orphans.gone(pids, bound(5.0))


def test_pool_kills_a_workers_children_on_timeout_and_at_close_and_cuts_their_output(tmp_path, capfd):
    pid_file = tmp_path / "pids"
    with TimeoutPool(workers=1, preload=["orphan_rewards_for_tests"]) as pool:
        with pytest.raises(TimeoutError):
            pool.run_sync(orphans.sleeper_then_hang, str(pid_file), timeout=1.5)  # starts its child first
        assert _gone(_pids(pid_file, 1))  # hung call: its worker and the worker's child killed together
        capfd.readouterr()

        async def flood() -> list[str]:
            return [await pool.run(orphans.print_flood, 2_000_000, timeout=bound(30.0)) for _ in range(2)]

        assert asyncio.run(flood()) == ["done", "done"]
        assert pool.run_sync(orphans.print_flood, 100, timeout=bound(30.0)) == "done"  # under the limit: whole
        time.sleep(0.3)  # the worker's drain threads forward asynchronously
        out, err = capfd.readouterr()
        assert len(out) + len(err) < 3 * (OUTPUT_LIMIT + 200)
        assert (out + err).count("output of this call cut after") == 2
        assert out.endswith("o" * 50) and err.endswith("e" * 50)
        left = pool.run_sync(orphans.sleeper_then_return, str(pid_file), timeout=bound(10.0))
        assert orphans.alive(left)  # a call may leave a child running; it lives as long as its worker...
    assert _gone([left])  # ...and close() kills the group


def test_pool_workers_children_die_with_a_sigkilled_parent(tmp_path):
    pid_file = tmp_path / "pids"
    script = textwrap.dedent(f"""
        import asyncio, sys
        sys.path.insert(0, {TESTS_DIR!r})
        import orphan_rewards_for_tests as orphans
        from relayrl.judge import TimeoutPool

        if __name__ == "__main__":
            pool = TimeoutPool(workers=1)
            asyncio.run(pool.run(orphans.sleeper_then_hang, {str(pid_file)!r}, timeout=None))
    """)
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        pids = _pids(pid_file, 1)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        assert _gone(pids)
    finally:
        parent.kill()
