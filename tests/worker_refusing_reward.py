"""A reward module that imports in the parent but refuses to load in a judge worker: the build then fails
after the run folder exists (judge.wait_ready), which is what tests/integration/test_trust_runs.py needs."""

import multiprocessing

if multiprocessing.parent_process() is not None:
    raise ImportError("this reward module refuses to load in a worker process")


def reward(response: str, data: dict) -> float:
    return 0.0
