"""Reward functions that misbehave at the process level (issue 58): they start children that outlive the call,
hang, or print without end. Standard library only, so judge workers start fast (see rewards_for_tests)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

PIDS_ENV = "RELAYRL_TEST_ORPHAN_PIDS"  # a file each call appends its sleeping grandchild's pid to


def start_sleeper(pid_file: str) -> int:
    """Start a grandchild that sleeps for minutes (not waited for), record its pid; returns it."""
    child = subprocess.Popen(["sleep", "300"])
    with open(pid_file, "a") as f:
        f.write(f"{child.pid}\n")
    return child.pid


def sleeper_then_hang(pid_file: str, seconds: float = 300.0) -> float:
    start_sleeper(pid_file)
    time.sleep(seconds)
    return 1.0


def sleeper_then_return(pid_file: str) -> int:
    return start_sleeper(pid_file)


def print_flood(n_bytes: int) -> str:
    """Print n_bytes to stdout and to stderr, from Python and through the file descriptors."""
    sys.stdout.write("o" * (n_bytes // 2))
    os.write(2, b"e" * (n_bytes // 2))
    return "done"


def orphaning_reward(response: str, data: dict[str, Any]) -> float:
    """A run's reward: every call leaves a sleeping grandchild; the run's first call also prints a flood and
    hangs past judge.timeout."""
    start_sleeper(os.environ[PIDS_ENV])
    with open(os.environ[PIDS_ENV]) as f:
        first = len(f.read().split()) == 1
    if first:
        sys.stdout.write("x" * 200_000)
        sys.stdout.flush()
        time.sleep(300)
    return float(len(response) % 2)


# ---- the tests' side ----------------------------------------------------------------------------------------
def alive(pid: int) -> bool:
    """Alive and not a zombie (a container's pid 1 may never reap orphans)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def gone(pids: list[int], timeout: float) -> bool:
    """Whether every pid is dead within `timeout` seconds (a SIGKILL is delivered at once, reaping may lag)."""
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(alive(p) for p in pids)
