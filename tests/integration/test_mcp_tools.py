"""MCP servers as tool providers: a real MCP server (tests/mcp_server_for_tests.py, on the official SDK) over
stdio and over streamable HTTP on 127.0.0.1; its tools listed at start-up, called through the SDK, a hanging
call bounded, one session per server per process, closed with the agents, servers that do not start refused
before any model loads, and the ToolAgent end to end on a real tiny model calling an MCP tool."""

import asyncio
import contextlib
import json
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
from bounds import bound
from conftest import tiny_run_args, write_sums
from engines_for_tests import memorize

from relayrl.agents.tool import ToolAgent
from relayrl.cli import main
from relayrl.common.errors import InputError
from relayrl.common.net import free_port
from relayrl.engine.base import SamplingParams
from relayrl.engine.local import LocalEngine
from relayrl.engine.rollout import RolloutController
from relayrl.models import eos_token_ids, load_model, load_tokenizer
from relayrl.run.build import _check_agent_kwargs
from relayrl.sample import NO_VERSION, Sample
from relayrl.tools import mcp

SERVER = str(Path(__file__).parents[1] / "mcp_server_for_tests.py")
CAPITAL_INPUT = {"properties": {"country": {"title": "Country", "type": "string"}}, "required": ["country"],
                 "type": "object", "title": "capitalArguments"}


def stdio_spec(**extra) -> dict:
    """A stdio server; the marker argument finds its process in /proc (the server ignores it)."""
    return {"command": sys.executable, "args": [SERVER, "stdio", f"marker-{uuid.uuid4().hex}"], **extra}


def running(spec: dict) -> bool:
    marker = spec["args"][-1].encode()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            if marker in cmdline.read_bytes():
                return True
    return False


@pytest.fixture(scope="module")
def http_url():
    """The same server over streamable HTTP, on a free port of 127.0.0.1."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, SERVER, "http", str(port)], stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.TransportError):
                httpx.get(url, timeout=1)
                break
            assert proc.poll() is None and time.monotonic() < deadline, "the MCP test server did not start"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def call(agent: ToolAgent, name: str, **arguments) -> tuple[str, bool]:
    return asyncio.run(agent.run_call({"name": name, "arguments": arguments}))


def test_stdio_server_tools_listed_called_and_closed(tiny_path):
    spec = stdio_spec(timeout=1)
    tok = load_tokenizer(tiny_path)
    agent = ToolAgent(None, tok, SamplingParams(), mcp_servers=[spec], tools=["calculator"])
    assert list(agent.tools) == ["calculator", "capital", "add", "broken", "stall"]
    assert agent.tools["capital"].schema() == {"type": "function", "function": {
        "name": "capital", "description": "The capital city of a country.", "parameters": CAPITAL_INPUT}}
    assert call(agent, "capital", country="Japan") == ("Tokyo", True)
    assert call(agent, "add", a=2, b=40) == ("42", True)
    assert call(agent, "broken", reason="no map") == ("error: Error executing tool broken: no map", False)
    text, ok = call(agent, "add", a="two")
    assert not ok and text.startswith("error: Error executing tool add: ") and "validation error" in text
    t0 = time.monotonic()
    assert call(agent, "stall", seconds=60) == ("error: tool stall timed out after 1s", False)  # the spec's timeout
    assert time.monotonic() - t0 < bound(5)
    assert call(agent, "capital", country="Kenya") == ("Nairobi", True)  # the session outlives a timed-out call
    # an eval agent of the same process shares the session; the last one to close ends the server
    eval_agent = ToolAgent(None, tok, SamplingParams(), mcp_servers=[spec], tool_options={"stall": {"timeout": 3}})
    assert eval_agent._servers == agent._servers and eval_agent.tools["stall"].timeout == 3
    assert agent.tools["stall"].timeout == 1 and list(eval_agent.tools)[0] == "capital"  # no built-ins asked for
    agent.close()
    assert running(spec) and call(eval_agent, "add", a=1, b=1) == ("2", True)
    eval_agent.close()
    deadline = time.monotonic() + 10
    while running(spec) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(spec) and not mcp._POOL


def test_http_server(tiny_path, http_url):
    agent = ToolAgent(None, load_tokenizer(tiny_path), SamplingParams(), mcp_servers=[{"url": http_url}])
    try:
        assert agent.tools["capital"].parameters == CAPITAL_INPUT
        assert call(agent, "capital", country="France") == ("Paris", True)
        assert call(agent, "teleport") == ("error: unknown tool 'teleport'; available: capital, add, broken, stall",
                                           False)
    finally:
        agent.close()


@pytest.mark.parametrize("spec, why", [
    ({"command": "/nonexistent/mcp-server"}, "/nonexistent/mcp-server did not start: FileNotFoundError"),
    ({"command": sys.executable, "args": ["-c", "import sys; sys.exit(3)"]},
     f"{sys.executable} -c import sys; sys.exit(3) did not start: MCPError: Connection closed"),
    ({"command": sys.executable, "args": ["-c", "import time; time.sleep(60)"], "start_timeout": 1},
     f"{sys.executable} -c import time; time.sleep(60) did not start: no answer within 1s"),
    ("url-of-a-closed-port", "did not start: ConnectError"),
    ({"url": "http://127.0.0.1:1/mcp", "command": "x"}, "give exactly one of `command`"),
    ({"command": "x", "argv": []}, "unknown keys ['argv']"),
])
def test_servers_that_do_not_start_are_refused(spec, why):
    if spec == "url-of-a-closed-port":
        spec = {"url": f"http://127.0.0.1:{free_port()}/mcp"}
        why = f"MCP server {spec['url']} {why}"
    t0 = time.monotonic()
    with pytest.raises(InputError) as e:
        _check_agent_kwargs(ToolAgent, {"mcp_servers": [stdio_spec(), spec]})
    assert str(e.value).startswith("agent.kwargs.mcp_servers[1]: ") and why in str(e.value), str(e.value)
    assert time.monotonic() - t0 < 30 and not mcp._POOL  # the first server, started, is closed again


def test_without_the_sdk_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mcp", None)  # as where the `agents` extra is not installed
    with pytest.raises(InputError, match=r"^agent\.kwargs\.mcp_servers\[0\]: MCP servers need the mcp package: "
                                         + re.escape("pip install -e '.[agents]' in the relayrl checkout") + "$"):
        _check_agent_kwargs(ToolAgent, {"mcp_servers": [{"command": "x"}]})


def test_cli_refuses_a_server_that_does_not_start_before_loading_models(tiny_path, tmp_path, capsys):
    code = main(["train", f"model.path={tiny_path}", f"data.train.source={write_sums(tmp_path / 'd.jsonl', 4)}",
                 f"run.output_dir={tmp_path / 'runs'}", "agent.kind=tool",
                 "agent.kwargs={mcp_servers: [{command: /nonexistent/mcp-server, args: [--stdio]}]}"])
    err = capsys.readouterr().err
    assert code == 2 and ("agent.kwargs.mcp_servers[0]: MCP server /nonexistent/mcp-server --stdio did not start: "
                          "FileNotFoundError") in err, err
    assert "Traceback" not in err and not (tmp_path / "runs").exists()


def test_a_run_closes_its_servers(tiny_path, tmp_path):
    """`relayrl train` with an MCP server and a user tool: the server runs while the agents do, and the run's
    end closes it (not the process's exit)."""
    spec = stdio_spec()
    kwargs = json.dumps({"tools": ["tools_for_tests:capital_of"], "mcp_servers": [spec]})  # JSON is YAML
    data = write_sums(tmp_path / "d.jsonl", 8)
    assert main(["train", *tiny_run_args(tiny_path, data, tmp_path / "runs", **{
        "agent.kind": "tool", "agent.kwargs": kwargs, "run.steps": 1})]) == 0
    assert not mcp._POOL and not running(spec)


def test_mcp_tool_end_to_end(tiny_path):
    """A real tiny model taught to call the server's `capital`: its answer comes back as template tokens."""
    tok = load_tokenizer(tiny_path)
    model = load_model(tiny_path)
    engine = LocalEngine(model, eos_token_ids=eos_token_ids(tok, tiny_path), max_batch_size=2)
    agent = ToolAgent(RolloutController([engine]), tok, SamplingParams(max_new_tokens=128, temperature=0), None,
                      mcp_servers=[stdio_spec()], max_turns=2)
    row = {"question": "What is the capital of Kenya?"}
    prompt = agent.prompt_ids(row)
    emitted = tok('<tool_call>{"name": "capital", "arguments": {"country": "Kenya"}}</tool_call>',
                  add_special_tokens=False)["input_ids"] + [agent.eot]
    memorize(model, prompt, emitted)
    try:
        s = asyncio.run(agent.generate_sample(Sample(prompt_ids=[0], data=row)))
    finally:
        engine.close()
        agent.close()
    assert "- capital(country): The capital city of a country." in tok.decode(prompt)
    assert s.response_ids[: s.turns[0].end] == emitted
    tool_ids = s.response_ids[s.turns[0].end: s.turns[1].start]
    assert tok.decode(tool_ids) == "\n<|im_start|>tool\nNairobi<|im_end|>\n<|im_start|>assistant\n"
    assert set(s.loss_mask[s.turns[0].end: s.turns[1].start]) == {0}
    assert set(s.versions[s.turns[0].end: s.turns[1].start]) == {NO_VERSION}
    assert s.metrics["tool_calls"] == 1 and s.metrics["tool_errors"] == 0
