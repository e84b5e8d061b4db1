"""engine.launch at scale: server arguments passed through to a launched `relayrl serve` (a real subprocess on
127.0.0.1), refused before any model loads when the server would refuse them, SGLang's command line (SGLang runs
only where CUDA is: the argv is checked here, the start-up refusal too), `relayrl serve --device`, and a launched
server killed in the middle of a run reported with its name and its log."""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from conftest import write_sums

from relayrl import cli
from relayrl.config.engine import EngineConfig
from relayrl.config.loader import ConfigError
from relayrl.config.schema import load_run_config
from relayrl.engine import EngineUnavailable
from relayrl.run.build import build
from relayrl.run.launcher import (
    check_launch,
    make_server,
    relayrl_server,
    sglang_server,
    vllm_args_problem,
    vllm_server,
)
from relayrl.run.loop import train_steps


def _run_config(tiny_path: str, tmp_path: Path, *overrides: str):
    data = write_sums(tmp_path / "sums.jsonl", 8)
    return load_run_config(None, [
        f"model.path={tiny_path}", f"data.train.source={data}", "data.batch_size=2", "data.group_size=2",
        "sampling.max_new_tokens=4", "run.steps=3", f"run.output_dir={tmp_path}", "run.name=launched",
        "judge.workers=1", "run.print_samples=0", "engine.kind=remote", "engine.launch=relayrl",
        "engine.dtype=float32", "engine.max_batch_size=4", "engine.retries=0", *overrides])


def test_server_args_the_server_refuses_stop_the_run_before_any_model_loads(tiny_path, tmp_path):
    refuses = "relayrl serve refuses them: "
    for args, says in [("[--max-batch, 8]", "--max-batch-size is set by relayrl itself .from engine.max_batch_size"),
                       ("[--no-such-flag, 1]", refuses + "unrecognized arguments: --no-such-flag"),
                       ("[--max-n, 0]", refuses + "argument --max-n: must be >= 1"),
                       ("[--device, gpu]", refuses + "argument --device: must be auto, cpu, cuda or cuda:N")]:
        cfg = _run_config(tiny_path, tmp_path, f"engine.server_args={args}")
        t0 = time.monotonic()
        with pytest.raises(ConfigError, match=f"engine.server_args: {says}"):
            build(cfg)
        assert time.monotonic() - t0 < 5  # no server started, no model loaded
    assert not (tmp_path / "launched").exists()  # and no run folder left behind
    # what the config alone can tell: the plain spellings of the flags relayrl sets, and server_args without a launch
    with pytest.raises(ConfigError, match="engine.server_args: --port is set by relayrl itself"):
        _run_config(tiny_path, tmp_path, "engine.server_args=[--port=8000]")
    with pytest.raises(ConfigError, match="engine.server_args: --model-path is set by relayrl itself .from model.path"):
        _run_config(tiny_path, tmp_path, "engine.launch=sglang", "engine.server_args=[--model-path, x]")
    with pytest.raises(ConfigError, match="engine.server_args: only for servers the run starts"):
        load_run_config(None, [f"model.path={tiny_path}", "engine.server_args=[--tp-size, 2]"])


def test_vllm_server_args_are_not_checked_without_its_interpreter(tmp_path, caplog):
    e = EngineConfig(kind="remote", backend="vllm", launch="vllm", vllm_python=str(tmp_path / "none"),
                     server_args=["--tensor-parallel-size", 2])
    with caplog.at_level(logging.WARNING, logger="relayrl.run.launcher"):
        check_launch(e)
    assert "engine.server_args not checked: engine.vllm_python" in caplog.text
    assert vllm_args_problem(sys.executable, ["--x"]) is None  # no vLLM in this interpreter: skipped, not refused


# vLLM's parser API as relayrl's check uses it (FlexibleArgumentParser, make_arg_parser), for the check's own logic:
# vLLM itself does not install here (tests/e2e/test_vllm.py runs against the real one where it does)
_STAND_IN = {
    "vllm/__init__.py": "",
    "vllm/utils/__init__.py": """import argparse
class FlexibleArgumentParser(argparse.ArgumentParser):
    def parse_args(self, args=None, namespace=None):  # vLLM's: --max_model_len means --max-model-len
        return super().parse_args([a.replace("_", "-") if a.startswith("--") else a for a in args], namespace)
""",
    "vllm/entrypoints/__init__.py": "",
    "vllm/entrypoints/openai/__init__.py": "",
    "vllm/entrypoints/openai/cli_args.py": """def make_arg_parser(parser):
    for flag in ("--model", "--host", "--api-key", "--dtype"):
        parser.add_argument(flag)
    for flag in ("--port", "--seed", "--max-model-len", "--tensor-parallel-size"):
        parser.add_argument(flag, type=int)
    return parser
""",
}


def test_vllm_server_args_are_tried_on_its_parser_in_its_interpreter(tmp_path, monkeypatch):
    for name, text in _STAND_IN.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert vllm_args_problem(sys.executable, ["--tensor-parallel-size", "2"]) is None
    assert vllm_args_problem(sys.executable, ["--max_model_len", "64"]) == (
        "--max-model-len is set by relayrl itself (from engine.max_seq_len; set that instead)")
    assert vllm_args_problem(sys.executable, ["--tensor-parallel-size", "two"]) == (
        "vLLM's server refuses them: argument --tensor-parallel-size: invalid int value: 'two'")
    assert vllm_args_problem(sys.executable, ["--bogus"]) == (
        "vLLM's server refuses them: unrecognized arguments: --bogus")


def test_sglang_command_line_and_its_refusal_where_it_cannot_run(tiny_path, tmp_path):
    server = sglang_server("/envs/sglang/bin/python", tiny_path, tmp_path / "s.log", dtype="bfloat16",
                           context_length=2048, api_key="k", seed=7, host="127.0.0.1",
                           extra=["--tp-size", "2", "--mem-fraction-static", "0.8"])
    port = str(server.port)
    assert server.cmd == ["/envs/sglang/bin/python", "-m", "sglang.launch_server", "--model-path", tiny_path,
                          "--host", "127.0.0.1", "--port", port, "--dtype", "bfloat16", "--random-seed", "7",
                          "--context-length", "2048", "--api-key", "k", "--tp-size", "2", "--mem-fraction-static",
                          "0.8"]
    assert server.url == f"http://127.0.0.1:{port}" and server.name == "sglang server"
    e = EngineConfig(kind="remote", launch="sglang", dtype="bfloat16", server_args=["--tp-size", 2])
    e.validate()
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed here")
    with pytest.raises(ConfigError, match="engine.launch: sglang is not installed for .* runs only where CUDA is"):
        make_server(e, tiny_path, tmp_path / "sglang-0.log", seed=0)
    e = EngineConfig(kind="remote", launch="sglang", sglang_python=str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="engine.launch: sglang: engine.sglang_python .*nowhere does not exist"):
        make_server(e, tiny_path, tmp_path / "sglang-0.log", seed=0)


def test_serve_device_cuda_without_cuda_is_one_line(tiny_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert cli.main(["serve", "--model", tiny_path, "--device", "cuda", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("relayrl serve: --device: device 'cuda': CUDA is not available") and "\n" not in err


def test_launched_server_gets_its_args_and_its_death_mid_run_names_it_and_its_log(tiny_path, tmp_path, caplog):
    cfg = _run_config(tiny_path, tmp_path, "engine.server_args=[--served-model-name, policy, alias, --max-n, 4]")
    c = build(cfg)
    server = c.servers[0]
    try:
        models = httpx.get(f"{server.url}/v1/models", timeout=10).json()  # the passthrough reached the server
        assert [m["id"] for m in models["data"]] == ["policy", "alias"]
        with caplog.at_level(logging.ERROR, logger="relayrl.run.launcher"):
            os.kill(server.proc.pid, signal.SIGKILL)  # the server dies while the run uses it
            with pytest.raises(EngineUnavailable, match=server.url.replace(".", r"\.")):
                train_steps(c)
            deadline = time.monotonic() + 5
            while server.death is None and time.monotonic() < deadline:
                time.sleep(0.05)
        death = server.death or ""
        assert death.startswith(f"relayrl serve at {server.url} (pid {server.proc.pid}) was killed by SIGKILL "
                                "while the run was using it")
        assert str(server.log_path) in death and "ready on" in death  # the log's tail, quoted
        assert server.log_path == tmp_path / "launched" / "servers" / "relayrl-0.log"
        assert [r.getMessage() for r in caplog.records if r.name == "relayrl.run.launcher"] == [death]  # once
    finally:
        c.close()


def test_a_launched_server_gets_its_api_key_through_the_environment_not_its_arguments(tiny_path, tmp_path):
    """Every local user can read a process's arguments (/proc/PID/cmdline), not its environment."""
    server = relayrl_server(tiny_path, tmp_path / "keyed.log", dtype="float32", api_key="s3cret-key")
    server.start().wait_ready(120)
    try:
        assert b"s3cret-key" not in Path(f"/proc/{server.proc.pid}/cmdline").read_bytes()
        assert "s3cret-key" not in server.log_tail()  # and no warning that it was visible
        assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 401
        auth = {"Authorization": "Bearer s3cret-key"}
        assert httpx.get(server.url + "/v1/models", headers=auth, timeout=10).status_code == 200
    finally:
        server.stop()


def test_a_launched_vllm_for_a_lora_run_loads_adapters_at_run_time_and_gets_its_key_from_the_environment(tmp_path):
    python = tmp_path / "python"
    python.write_text("")  # vllm_server checks the interpreter exists; nothing is started here
    server = vllm_server(str(python), "m", tmp_path / "v.log", api_key="k", lora_rank=12)
    assert server.cmd[server.cmd.index("--max-lora-rank") + 1] == "16"  # the next rank vLLM accepts
    assert "--enable-lora" in server.cmd and "k" not in server.cmd
    assert server._env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1" and server._env["VLLM_API_KEY"] == "k"
    plain = vllm_server(str(python), "m", tmp_path / "v.log")
    assert "--enable-lora" not in plain.cmd and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in plain._env
