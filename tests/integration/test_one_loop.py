"""Sync and async RL share one loop body (relayrl.run.loop.train_steps): a fixed-seed sync run through it gives
the batches and metrics that the sync loop of before gave (tests/fixtures/one_loop_golden.json, recorded with it:
tests/one_loop_for_tests.py), and an async run logs the metric keys the async loop of before logged."""

import json

import pytest
from conftest import write_sums
from one_loop_for_tests import GOLDEN, key_sets, mismatches, run

from relayrl.run.loop import train_steps


@pytest.fixture(scope="module")
def golden():
    return json.loads(GOLDEN.read_text())


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_sums(tmp_path_factory.mktemp("one_loop") / "sums.jsonl", 12)


def test_sync_run_gives_the_recorded_batches_and_metrics(tiny_path, data, tmp_path, golden):
    got = run(tiny_path, data, str(tmp_path), train_steps, **{"run.name": "sync"})
    assert len(got["batches"]) == 3 and all(len(b) == 4 for b in got["batches"])
    assert mismatches(got, golden["sync"]) == []


def test_async_run_logs_the_recorded_metric_keys(tiny_path, data, tmp_path, golden):
    got = run(tiny_path, data, str(tmp_path), train_steps, **{
        "run.name": "async", "scheduler.mode": "async", "scheduler.max_staleness": 1})
    assert key_sets(got) == golden["async_keys"]
