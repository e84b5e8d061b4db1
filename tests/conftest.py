"""Shared fixtures: a real tiny model (random init, small vocab) built once per session."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_path():
    from relayrl.models import tiny_model

    return str(tiny_model("qwen2"))
