"""Tools from the user's code (tests/tools_for_tests.py): the schema from type hints and docstring, exactly;
functions refused at start-up without them; async tools; a tool that hangs or raises costs one call; and the
ToolAgent end to end on a real tiny model calling a user function."""

import asyncio
import json
import threading
import time
from pathlib import Path

import pytest
import tools_for_tests
from conftest import write_sums
from engines_for_tests import memorize

from relayrl.agents.tool import ToolAgent
from relayrl.cli import main
from relayrl.common.errors import InputError
from relayrl.engine.base import SamplingParams
from relayrl.engine.local import LocalEngine
from relayrl.engine.rollout import RolloutController
from relayrl.models import eos_token_ids, load_model, load_tokenizer
from relayrl.run.build import _check_agent_kwargs
from relayrl.sample import NO_VERSION, Sample
from relayrl.tools.functions import MAX_RESULT_CHARS, as_text, function_tool

TOOLS_FILE = str(Path(tools_for_tests.__file__))
CAPITAL_SCHEMA = {"type": "function", "function": {
    "name": "capital_of", "description": "Look up the capital city of a country.",
    "parameters": {"type": "object", "properties": {
        "country": {"type": "string", "description": "The country's English name, e.g. France."},
        "style": {"type": "string", "enum": ["plain", "shout"], "description": "How to write the answer."}},
        "required": ["country"]},
    "return": {"type": "string", "description": 'The capital\'s name, or "unknown".'}}}
ADD_SCHEMA = {"type": "function", "function": {
    "name": "add_all", "description": "Add numbers, awaiting like a tool that calls a service.",
    "parameters": {"type": "object", "properties": {
        "numbers": {"type": "array", "items": {"type": "number"}, "description": "The numbers to add."},
        "offset": {"type": "integer", "nullable": True, "description": "Added to the sum when given."}},
        "required": ["numbers"]},
    "return": {"type": "object"}}}


def agent(tok, **kwargs) -> ToolAgent:
    return ToolAgent(None, tok, SamplingParams(), **kwargs)


def call(a: ToolAgent, name: str, **arguments) -> tuple[str, bool]:
    return asyncio.run(a.run_call({"name": name, "arguments": arguments}))


def test_schema_from_hints_and_docstring_exactly(tiny_path):
    assert function_tool(tools_for_tests.capital_of).schema() == CAPITAL_SCHEMA
    assert function_tool(tools_for_tests.add_all).schema() == ADD_SCHEMA
    # by import path and as a function object alike, in the order given, beside a built-in
    a = agent(load_tokenizer(tiny_path), tools=["tools_for_tests:capital_of", tools_for_tests.add_all, "calculator"])
    assert list(a.tools) == ["capital_of", "add_all", "calculator"]
    assert a.tools["capital_of"].schema() == CAPITAL_SCHEMA


@pytest.mark.parametrize("name, line, why", [
    ("no_hints", 65, "Argument country is missing a type hint in function no_hints"),
    ("no_doc", 75, "Cannot generate JSON schema for no_doc because it has no docstring"),
])
def test_functions_without_hints_or_docstring_are_refused(tiny_path, name, line, why):
    expected = f"agent.kwargs.tools[1]: {name} ({TOOLS_FILE}:{line}) cannot be a tool: {why}; a tool needs"
    with pytest.raises(InputError) as e:
        agent(load_tokenizer(tiny_path), tools=["calculator", f"tools_for_tests:{name}"])
    assert str(e.value).startswith(expected), str(e.value)
    with pytest.raises(InputError) as e:  # the start-up check: no model, no sandbox probe
        _check_agent_kwargs(ToolAgent, {"tools": ["python", getattr(tools_for_tests, name)]})
    assert str(e.value).startswith(expected), str(e.value)


def test_cli_refuses_an_untyped_tool_before_loading_models(tiny_path, tmp_path, capsys):
    code = main(["train", f"model.path={tiny_path}", f"data.train.source={write_sums(tmp_path / 'd.jsonl', 4)}",
                 f"run.output_dir={tmp_path / 'runs'}", "agent.kind=tool",
                 "agent.kwargs={tools: [calculator, 'tools_for_tests:no_hints']}"])
    err = capsys.readouterr().err
    assert code == 2 and "agent.kwargs.tools[1]: no_hints (" in err and "missing a type hint" in err, err
    assert "Traceback" not in err and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("tools, why", [
    (["teleport"], "agent.kwargs.tools[0]: unknown tool 'teleport'; built-in: calculator, python"),
    (["tools_for_tests:nothing"], "agent.kwargs.tools[0]: module 'tools_for_tests' has no attribute 'nothing'"),
    (["calculator", "tools_for_tests:CAPITALS"], "agent.kwargs.tools[1]: a tool is a built-in name, an import path"),
    (["tools_for_tests:capital_of", tools_for_tests.capital_of],
     "agent.kwargs.tools: more than one tool is named capital_of;"),
])
def test_bad_tool_entries(tiny_path, tools, why):
    with pytest.raises(InputError, match="^" + why.replace("[", r"\[").replace("]", r"\]")):
        agent(load_tokenizer(tiny_path), tools=tools)


def test_sync_and_async_tools_and_their_results(tiny_path):
    a = agent(load_tokenizer(tiny_path), tools=[tools_for_tests.capital_of, tools_for_tests.add_all,
                                                tools_for_tests.explode])
    assert call(a, "capital_of", country="Japan", style="shout") == ("TOKYO", True)
    assert call(a, "add_all", numbers=[1, 2.5], offset=3) == ('{"sum": 6.5}', True)  # JSON for non-strings
    text, ok = call(a, "capital_of", city="Japan")
    assert (text, ok) == ("error: bad arguments for capital_of: missing a required argument: 'country'", False)
    assert call(a, "explode", reason="the map is blank") == (
        "error: tool explode raised ValueError: the map is blank", False)
    assert as_text("x" * (MAX_RESULT_CHARS + 5)) == "x" * MAX_RESULT_CHARS + "\n[output truncated]"


@pytest.mark.parametrize("name", ["hang", "hang_async"])
def test_a_hanging_tool_costs_one_call(tiny_path, name):
    a = agent(load_tokenizer(tiny_path), tools=[getattr(tools_for_tests, name), tools_for_tests.capital_of],
              tool_options={name: {"timeout": 0.5}}, tool_timeout=30)

    async def two_calls():
        hung = await a.run_call({"name": name, "arguments": {"seconds": 120}})
        return hung, await a.run_call({"name": "capital_of", "arguments": {"country": "Kenya"}})

    t0 = time.monotonic()
    hung, after = asyncio.run(two_calls())
    assert hung == (f"error: tool {name} timed out after 0.5s", False)
    assert after == ("Nairobi", True) and time.monotonic() - t0 < 5  # the next call runs; nothing waited 120 s
    if name == "hang":  # the abandoned thread is a daemon: a hung tool does not hold the process's exit either
        assert all(t.daemon for t in threading.enumerate() if t.name == "relayrl-tool-hang")
        assert any(t.name == "relayrl-tool-hang" for t in threading.enumerate())
    with pytest.raises(InputError, match=r"agent\.kwargs\.tool_options\.hang: unknown options \['retries'\]"):
        agent(load_tokenizer(tiny_path), tools=[tools_for_tests.hang], tool_options={"hang": {"retries": 2}})


def test_a_template_with_tools_gets_the_schema(tiny_path):
    tok = load_tokenizer(tiny_path)
    tok.chat_template = (Path(__file__).parents[1] / "fixtures" / "chat_templates" / "qwen2.5-instruct.jinja"
                         ).read_text()
    a = agent(tok, tools=["tools_for_tests:capital_of"])
    assert json.dumps(CAPITAL_SCHEMA) in tok.decode(a.prompt_ids({"question": "What is the capital of Japan?"}))


def test_user_tool_end_to_end(tiny_path):
    """A real tiny model taught to call capital_of: the result comes back as template tokens, not trained on."""
    tok = load_tokenizer(tiny_path)
    model = load_model(tiny_path)
    engine = LocalEngine(model, eos_token_ids=eos_token_ids(tok, tiny_path), max_batch_size=2)
    a = ToolAgent(RolloutController([engine]), tok, SamplingParams(max_new_tokens=128, temperature=0), None,
                  tools=["tools_for_tests:capital_of"], max_turns=2)
    row = {"question": "What is the capital of Japan?"}
    prompt = a.prompt_ids(row)
    emitted = tok('<tool_call>{"name": "capital_of", "arguments": {"country": "Japan"}}</tool_call>',
                  add_special_tokens=False)["input_ids"] + [a.eot]
    memorize(model, prompt, emitted)
    try:
        s = asyncio.run(a.generate_sample(Sample(prompt_ids=[0], data=row)))
    finally:
        engine.close()
    assert "- capital_of(country, style): Look up the capital city of a country." in tok.decode(prompt)
    assert s.response_ids[: s.turns[0].end] == emitted
    tool_text = tok.decode(s.response_ids[s.turns[0].end: s.turns[1].start])
    assert tool_text == "\n<|im_start|>tool\nTokyo<|im_end|>\n<|im_start|>assistant\n"
    assert set(s.loss_mask[s.turns[0].end: s.turns[1].start]) == {0}
    assert set(s.versions[s.turns[0].end: s.turns[1].start]) == {NO_VERSION}
    assert s.metrics["tool_calls"] == 1 and s.metrics["tool_errors"] == 0
