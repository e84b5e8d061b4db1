"""Shared fixtures: a real tiny model (random init, small vocab) built once per session, the tests folder on
sys.path (configs name test agents and rewards by import path; judge workers inherit sys.path), a small
arithmetic dataset writer, and the settings of a tiny run (`tiny_run_args`, the `tiny_run` fixture) that the
loop, checkpoint, async and memory tests start from.

Layout: unit/ (one component, in process), integration/ (several components, real processes and servers),
e2e/ (the product as a user runs it: real SmolLM2, vLLM, an installed wheel, the Python API example, GPUs).
Helpers shared across them live here, at the top of tests/."""

import contextlib
import json
import os
from pathlib import Path

import pytest

TESTS = str(Path(__file__).parent)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):  # tests run N at a time (.ci/run: pytest -n): one torch thread each,
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # else N x cores threads fight over the cores


@pytest.fixture(scope="session")
def tiny_path():
    from relayrl.models import tiny_model

    return str(tiny_model("qwen2"))


@pytest.fixture(scope="session")
def tiny_moe_path():
    """A tiny random Qwen3-MoE (8 experts, 2 per token, every layer sparse) with the same tokenizer."""
    from relayrl.models import tiny_model

    return str(tiny_model("qwen3_moe"))


@pytest.fixture(scope="session")
def tiny_vlm_path():
    """A tiny random Idefics3 (a Llama text model, 16 image tokens per 64 x 64 image) with its processor."""
    from relayrl.models import tiny_vlm_model

    return str(tiny_vlm_model())


# A tiny run: the tiny model in fp32 (precision pinned: `auto` differs between CPU kinds, bf16 autocast where
# native), 2 prompts x 2 samples, 10 new tokens, 2 steps, a fast judge (its reward module imports no torch:
# rewards_for_tests), no extra output.
TINY_RUN = {"engine.dtype": "float32", "model.autocast_bf16": False, "data.batch_size": 2, "data.group_size": 2,
            "sampling.max_new_tokens": 10, "run.steps": 2, "run.name": "t", "train.lr": 1e-3,
            "judge.reward_fn": "rewards_for_tests:parity_reward",
            "judge.workers": 1, "run.print_samples": 0, "run.tensorboard": False, "run.save_final": False,
            "eval.at_start": False, "eval.at_end": False}

# what a user's run has on by default and TINY_RUN turns off, for tests that need it back
USER_OUTPUTS = {"run.tensorboard": True, "run.save_final": True, "eval.at_start": True, "eval.at_end": True}


def tiny_run_args(model: str, data: str, out: Path | str, **extra) -> list[str]:
    """key=value overrides of a tiny run of `model` on `data` writing under `out`, with `extra` on top."""
    over = {"model.path": model, "data.train.source": data, "run.output_dir": str(out), **TINY_RUN, **extra}
    return [f"{k}={v}" for k, v in over.items()]


@pytest.fixture
def tiny_run(tiny_path, tmp_path):
    """Build a tiny run's Config: `tiny_run(**{"run.steps": 3})`; its data (`tiny_run.data`) is 40 sums."""
    from relayrl.config.schema import load_run_config

    def make(**extra):
        return load_run_config(None, tiny_run_args(tiny_path, make.data, tmp_path, **extra))

    make.data = write_sums(tmp_path / "sums.jsonl", 40)
    return make


@pytest.fixture(autouse=True)
def tests_on_path(monkeypatch):
    monkeypatch.syspath_prepend(TESTS)


def write_sums(path: Path, n: int) -> str:
    """A JSONL dataset of n rows "What is i + i?" -> 2i; returns its path as a string (for config overrides)."""
    path.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n"
                            for i in range(n)))
    return str(path)


@contextlib.contextmanager
def run_folder_held_by_another_process(folder: Path):
    """A real second process holding `folder`'s run lock (relayrl.run.lock) until the block ends; yields it, so a
    test can name its pid. Killed on exit: the kernel then drops its lock."""
    import subprocess
    import sys
    import textwrap

    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from pathlib import Path
        from relayrl.run.lock import RunLock
        RunLock.acquire(Path({str(folder)!r}))
        print("locked", flush=True)
        time.sleep(300)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        yield holder
    finally:
        holder.kill()
        holder.wait()


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


def default_sigint() -> None:
    """Popen preexec_fn for tests that send SIGINT: a shell runs background jobs with SIGINT ignored, the child
    inherits that and Python then installs no KeyboardInterrupt handler, so Ctrl-C would never reach the run."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item, settings):
    """pytest-timeout's per-test limit (pyproject: timeout) scaled to the machine's load when the test starts
    (tests/bounds.py): a hung test still fails, one slowed by other processes does not."""
    import pytest_timeout
    from bounds import bound

    return pytest_timeout.pytest_timeout_set_timer(item, settings._replace(timeout=bound(settings.timeout)))
