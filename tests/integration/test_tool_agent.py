"""ToolAgent end to end on a real tiny model taught (by a few real optimizer steps) to emit a tool call."""

import asyncio

import pytest
from engines_for_tests import memorize
from sandbox_helpers import UNAVAILABLE

from relayrl.agents.chat import continuation_ids
from relayrl.agents.tool import ToolAgent
from relayrl.engine.base import SamplingParams
from relayrl.engine.local import LocalEngine
from relayrl.engine.rollout import RolloutController
from relayrl.models import eos_token_ids, load_model, load_tokenizer
from relayrl.sample import NO_VERSION, Sample
from relayrl.tools.calls import parse_tool_calls


def test_parse_tool_calls():
    calls = parse_tool_calls('x <tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call> '
                             '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
                             '<tool_call>{oops}</tool_call><tool_call>[1, 2]</tool_call>')
    assert calls[0] == {"name": "calculator", "arguments": {"expression": "2+2"}}
    assert calls[1] == {"name": "python", "arguments": {"code": "print(1)"}}
    assert calls[2].startswith("error: tool call is not valid JSON") and calls[3].startswith("error: a tool call")
    assert parse_tool_calls("no calls here") == []


@pytest.mark.parametrize("call, result", [
    ('{"name": "calculator", "arguments": {"expression": "6*7"}}', "42"),
    ('{"name": "calculator", "arguments": {"expression": 6*7}', "error: tool call is not valid JSON"),
    ('{"name": "teleport", "arguments": {}}', "error: unknown tool 'teleport'"),
    ('{"name": "python", "arguments": {"code": "print(sum(range(5)))"}}', "10"),
    ('{"name": "python", "arguments": {"script": "print(1)"}}', "error: bad arguments for python"),
])
def test_tool_call_round_trip(tiny_path, call, result):
    if UNAVAILABLE and '"python"' in call:
        pytest.skip(f"the python tool needs an OS sandbox, and none can start here: {UNAVAILABLE}")
    tok = load_tokenizer(tiny_path)
    model = load_model(tiny_path)
    engine = LocalEngine(model, eos_token_ids=eos_token_ids(tok, tiny_path), max_batch_size=2)
    agent = ToolAgent(RolloutController([engine]), tok, SamplingParams(max_new_tokens=128, temperature=0),
                      None, tools=["calculator"] if UNAVAILABLE else ["python", "calculator"], max_turns=2)
    row = {"question": "What is 6 times 7?"}
    prompt = agent.prompt_ids(row)
    emitted = tok(f"<tool_call>{call}</tool_call>", add_special_tokens=False)["input_ids"] + [agent.eot]
    memorize(model, prompt, emitted)
    try:
        s = asyncio.run(agent.generate_sample(Sample(prompt_ids=[0], data=row)))
    finally:
        engine.close()
    assert s.prompt_ids == prompt and "calculator(expression)" in tok.decode(prompt)
    assert s.response_ids[: s.turns[0].end] == emitted  # turn 1: the tool call, trained on
    tool_ids = s.response_ids[s.turns[0].end: s.turns[1].start]  # then the tool result, not trained on
    text = tok.decode(tool_ids)
    assert text.startswith("\n<|im_start|>tool\n" + result) and text.endswith("<|im_start|>assistant\n")
    expected = continuation_ids(tok, [{"role": "tool", "content": text.split("\n")[2].split("<|im_end|>")[0]}])
    assert tool_ids == expected
    assert set(s.loss_mask[s.turns[0].end: s.turns[1].start]) == {0}
    assert set(s.versions[s.turns[0].end: s.turns[1].start]) == {NO_VERSION}
    assert s.metrics["tool_calls"] == 1 and s.metrics["tool_errors"] == float(result.startswith("error"))
    assert len(s.turns) == 2  # max_turns reached
