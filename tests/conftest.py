"""Shared fixtures: a real tiny model (random init, small vocab) built once per session, the tests folder on
sys.path (configs name test agents and rewards by import path; judge workers inherit sys.path), and a small
arithmetic dataset writer."""

import contextlib
import json
import os
from pathlib import Path

import pytest

TESTS = str(Path(__file__).parent)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_path():
    from relayrl.models import tiny_model

    return str(tiny_model("qwen2"))


@pytest.fixture(autouse=True)
def tests_on_path(monkeypatch):
    monkeypatch.syspath_prepend(TESTS)


def write_sums(path: Path, n: int) -> str:
    """A JSONL dataset of n rows "What is i + i?" -> 2i; returns its path as a string (for config overrides)."""
    path.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n"
                            for i in range(n)))
    return str(path)


@contextlib.contextmanager
def relayrl_servers(model_path: str, logs: Path, n: int = 2, weights_root: Path | None = None):
    """n real `relayrl serve` subprocesses of a model (fp32, small batches), healthy, stopped on exit; they load
    weights from disk only from under `weights_root` (none: not at all)."""
    from relayrl.run.launcher import relayrl_server

    servers = [relayrl_server(model_path, logs / f"s{i}.log", dtype="float32", max_batch_size=8,
                              weights_root=weights_root).start() for i in range(n)]
    try:
        for s in servers:
            s.wait_ready(120)
        yield servers
    finally:
        for s in servers:
            s.stop()
