"""A normal run is quiet and says what it chose: the README's main job (examples/arithmetic_grpo.yaml), one step on
the tiny model, as a real `relayrl train` subprocess with Python's warnings shown (PYTHONWARNINGS=default) prints
no FutureWarning or DeprecationWarning, and its stderr holds each automatic choice once, as an INFO line, with the
judge's worker process logging at the run's level. `--log-level` and RELAYRL_LOG_LEVEL set that level."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from bounds import bound

from relayrl.cli import main
from relayrl.common import logs

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
# the main job, shrunk: one step of 2 prompts x 2 samples, 2 held-out prompts; the engine in fp32 so the CPU
# engine's choices (LM head, skinny linears) are made and logged on every CPU kind
SHRINK = {"engine.dtype": "float32", "data.train.size": 16, "data.batch_size": 2, "data.group_size": 2,
          "sampling.max_new_tokens": 8, "eval.size": 2, "eval.n": 1, "run.steps": 1, "run.save_final": False,
          "judge.workers": 1, "judge.reward_fn": "logging_reward:reward"}
# a reward function that logs from the judge's worker process, once: does the worker log at the run's level?
REWARD = '''import logging, os
from relayrl.judge.math import math_reward
log, said = logging.getLogger("relayrl.tests.reward"), []
def reward(response, data, **kwargs):
    if not said:
        said.append(True)
        log.info("judge worker %d scores with math_reward", os.getpid())
        log.debug("a judge worker's debug line")
    return math_reward(response, data, **kwargs)
'''
LOG_LINE = re.compile(r"^\d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR) (\S+): (.*)$", re.M)


@pytest.fixture(scope="module")
def job(tiny_path, tmp_path_factory):
    """`job(*args, **env)`: the shrunk main job with extra CLI arguments and environment variables."""
    tmp = tmp_path_factory.mktemp("quiet")
    (tmp / "logging_reward.py").write_text(REWARD)

    def run(*args: str, **env: str) -> subprocess.CompletedProcess:
        out = tmp / f"run{len(list(tmp.glob('run*')))}"
        over = {**SHRINK, "model.path": tiny_path, "run.output_dir": str(out)}
        environ = {k: v for k, v in os.environ.items() if k not in (logs.ENV, "PYTHONWARNINGS")}
        environ.update(PYTHONPATH=f"{REPO}:{TESTS}:{tmp}", PYTHONWARNINGS="default", HF_HUB_OFFLINE="1", **env)
        cmd = [sys.executable, "-m", "relayrl.cli", "train", "--config", "examples/arithmetic_grpo.yaml", *args,
               *[f"{k}={v}" for k, v in over.items()]]
        proc = subprocess.run(cmd, cwd=REPO, env=environ, text=True, capture_output=True, stdin=subprocess.DEVNULL,
                              timeout=bound(300))
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    return run


@pytest.fixture(scope="module")
def default_run(job):
    return job()


def records(text: str, level: str) -> list[tuple[str, str]]:
    return [(name, message) for lvl, name, message in LOG_LINE.findall(text) if lvl == level]


def test_a_normal_run_shows_no_deprecation_warning(default_run):
    both = default_run.stdout + default_run.stderr
    assert "FutureWarning" not in both and "DeprecationWarning" not in both, both[-3000:]


def test_a_normal_run_logs_each_choice_once_on_stderr(default_run):
    info = records(default_run.stderr, "INFO")
    repeated = [line for line, n in Counter(info).items() if n > 1]
    assert not repeated, repeated
    names = {name for name, _ in info}
    # the CPU fp32 engine's choices, and the judge's worker process at the run's level and format
    assert {"relayrl.engine.linear", "relayrl.engine.skinny", "relayrl.tests.reward"} <= names, info
    assert not records(default_run.stderr, "DEBUG")
    # stdout stays the run's report: the start block and the metrics table, no log records
    assert not LOG_LINE.search(default_run.stdout)
    assert default_run.stdout.count("precision: engine float32") == 1 and " step  reward" in default_run.stdout


def test_log_level_warning_hides_the_choices_and_wins_over_the_variable(job):
    proc = job("--log-level", "warning", RELAYRL_LOG_LEVEL="debug")
    assert not records(proc.stderr, "INFO") and not records(proc.stderr, "DEBUG"), proc.stderr[-3000:]
    assert " step  reward" in proc.stdout


def test_the_variable_at_debug_shows_debug_lines_in_every_process(job):
    proc = job(RELAYRL_LOG_LEVEL="debug")
    debug = records(proc.stderr, "DEBUG")
    assert ("relayrl.tests.reward", "a judge worker's debug line") in debug, proc.stderr[-3000:]
    assert {name for name, _ in records(proc.stderr, "INFO")} >= {"relayrl.engine.linear", "relayrl.tests.reward"}
    assert "FutureWarning" not in proc.stderr


def test_a_bad_level_in_the_variable_is_one_line_naming_it(monkeypatch, capsys):
    monkeypatch.setenv(logs.ENV, "loud")
    assert main(["train", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert err == "error: RELAYRL_LOG_LEVEL='loud': expected one of debug, info, warning, error\n"


def test_an_in_process_command_leaves_the_callers_logging_as_it_was(monkeypatch, capsys):
    monkeypatch.delenv(logs.ENV, raising=False)
    root = logging.getLogger()
    before = (list(root.handlers), root.level, logging.getLogger("relayrl").level)
    assert main(["train", "--log-level", "debug", "--print-config"]) == 0
    assert (list(root.handlers), root.level, logging.getLogger("relayrl").level) == before
    assert logs.ENV not in os.environ
