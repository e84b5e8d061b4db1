"""Tool-call formats (hermes, llama3, mistral): parsers on hand-written outputs, detection on the real chat
templates of Qwen2.5 / Llama 3.1 / Llama 3.2 / Mistral-7B-v0.3 (fixture files), and the ToolAgent end to end
on a real tiny model whose tokenizer renders with each template: the trajectory's ids must be the template's."""

import asyncio
import json
from pathlib import Path

import pytest
from conftest import write_sums
from engines_for_tests import memorize

from relayrl.agents.chat import continuation_ids
from relayrl.agents.tool import ToolAgent
from relayrl.cli import main
from relayrl.common.errors import InputError
from relayrl.engine.base import SamplingParams
from relayrl.engine.local import LocalEngine
from relayrl.engine.rollout import RolloutController
from relayrl.models import load_model, load_tokenizer
from relayrl.models.store import CHATML_TEMPLATE
from relayrl.run.build import _check_agent_kwargs
from relayrl.sample import NO_VERSION, Sample
from relayrl.tools.calls import (
    FORMATS,
    call_id,
    detect_format,
    parse_hermes,
    parse_llama3,
    parse_mistral,
    parse_tool_calls,
    resolve_format,
)

TEMPLATES = Path(__file__).parents[1] / "fixtures" / "chat_templates"
CALC = {"name": "calculator", "arguments": {"expression": "6*7"}}
PY = {"name": "python", "arguments": {"code": "print(1)"}}
LLAMA_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                "<|python_tag|>"]
MISTRAL_TOKENS = ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                  "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]
# fixture -> (the template's special tokens, bos, eos): what the real tokenizer has and the tiny one lacks
SPECS = {"qwen2.5-instruct": ([], None, "<|im_end|>"),
         "llama-3.1-instruct": (LLAMA_TOKENS, "<|begin_of_text|>", "<|eot_id|>"),
         "llama-3.2-instruct": (LLAMA_TOKENS, "<|begin_of_text|>", "<|eot_id|>"),
         "mistral-7b-instruct-v0.3": (MISTRAL_TOKENS, "<s>", "</s>")}


def template_tokenizer(tiny_path: str, fixture: str):
    """The tiny tokenizer, given the fixture template and the special tokens and bos/eos that template uses."""
    specials, bos, eos = SPECS[fixture]
    tok = load_tokenizer(tiny_path)
    tok.add_special_tokens({"additional_special_tokens": specials})
    if bos:
        tok.bos_token = bos
    tok.eos_token = eos
    tok.chat_template = (TEMPLATES / f"{fixture}.jinja").read_text()
    return tok


# ---- parsers -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("parse, text, expected", [
    # hermes
    (parse_hermes, '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>', [CALC]),
    (parse_hermes, '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>\n<tool_call>'
                   '{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>', [CALC, PY]),
    (parse_hermes, '<tool_call>{"name": "calculator", "arguments": {"expression": 6*7}</tool_call>', ["JSON"]),
    (parse_hermes, '<tool_call>{"arguments": {}}</tool_call>', ["SHAPE"]),
    (parse_hermes, "The answer is \\boxed{42}.", []),
    # llama3: the whole message, optionally after <|python_tag|>, calls separated by ;
    (parse_llama3, '{"name": "calculator", "parameters": {"expression": "6*7"}}', [CALC]),
    (parse_llama3, '<|python_tag|>{"name": "calculator", "parameters": {"expression": "6*7"}}', [CALC]),
    (parse_llama3, '{"name": "calculator", "parameters": {"expression": "6*7"}}; '
                   '{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}', [CALC, PY]),
    (parse_llama3, '{"name": "calculator", "parameters": {"expression": "6*7"}}; {"name": oops}', [CALC, "JSON"]),
    (parse_llama3, '{"parameters": {"expression": "6*7"}}', ["SHAPE"]),
    (parse_llama3, "The answer is \\boxed{42}. {\"name\": \"calculator\"}", []),
    # mistral: v3 JSON list, and the newer name[ARGS]{...}
    (parse_mistral, '[TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": "6*7"}}]', [CALC]),
    (parse_mistral, '[TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": "6*7"}}, '
                    '{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}]', [CALC, PY]),
    (parse_mistral, '[TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": 6*7}}]', ["JSON"]),
    (parse_mistral, '[TOOL_CALLS] [{"arguments": {}}, 7]', ["SHAPE", "SHAPE"]),
    (parse_mistral, '[TOOL_CALLS]calculator[ARGS]{"expression": "6*7"}[TOOL_CALLS]python[ARGS]{"code": "print(1)"}',
     [CALC, PY]),
    (parse_mistral, '[TOOL_CALLS]calculator[ARGS]{"expression": }', ["JSON"]),
    (parse_mistral, "The answer is \\boxed{42}.", []),
])
def test_parsers(parse, text, expected):
    calls = parse(text)
    assert len(calls) == len(expected), calls
    for call, want in zip(calls, expected, strict=True):
        if want == "JSON":
            assert call.startswith("error: tool call is not valid JSON")
        elif want == "SHAPE":
            assert call == 'error: a tool call must be {"name": ..., "arguments": {...}}'
        else:
            assert call == want


def test_mistral_keeps_valid_call_ids_and_hermes_stays_importable():
    calls = parse_mistral('[TOOL_CALLS] [{"name": "calculator", "arguments": {}, "id": "abc123XYZ"}, '
                          '{"name": "calculator", "arguments": {}, "id": "call_1"}]')
    assert calls == [{"name": "calculator", "arguments": {}, "id": "abc123XYZ"},
                     {"name": "calculator", "arguments": {}}]  # "call_1" is no valid Mistral id: one is made
    assert parse_tool_calls is not None and parse_tool_calls('<tool_call>{"name": "x"}</tool_call>') == \
        [{"name": "x", "arguments": {}}]
    assert len(call_id("uid", 0, 1)) == 9 and call_id("uid", 0, 1).isalnum() and call_id("uid", 0, 1) != \
        call_id("uid", 0, 2)


# ---- detection -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("fixture, name", [("qwen2.5-instruct", "hermes"), ("llama-3.1-instruct", "llama3"),
                                           ("llama-3.2-instruct", "llama3"), ("mistral-7b-instruct-v0.3", "mistral")])
def test_detect_on_real_templates(fixture, name):
    assert detect_format((TEMPLATES / f"{fixture}.jinja").read_text())[0] == name


def test_detect_fallback_and_explicit_choice():
    assert detect_format(CHATML_TEMPLATE) == (
        "hermes", "the chat template has no tool support; the system prompt describes the hermes format")
    assert detect_format(None)[0] == "hermes"
    fmt, why = resolve_format("mistral", CHATML_TEMPLATE)
    assert fmt is FORMATS["mistral"] and why == "set by agent.kwargs.tool_format"
    with pytest.raises(InputError, match=r"agent\.kwargs\.tool_format.*'pythonic'.*auto, hermes, llama3, mistral"):
        resolve_format("pythonic", CHATML_TEMPLATE)


def test_agent_takes_tool_format_and_describes_it_without_native_tools(tiny_path, caplog):
    tok = load_tokenizer(tiny_path)  # ChatML without tool support: the system prompt carries the format
    with pytest.raises(ValueError, match=r"agent\.kwargs\.tool_format"):
        ToolAgent(None, tok, SamplingParams(), tools=["calculator"], tool_format="pythonic")
    with caplog.at_level("INFO", logger="relayrl.agents.tool"):
        agent = ToolAgent(None, tok, SamplingParams(), tools=["calculator"], tool_format="llama3")
    assert agent.format.name == "llama3"
    assert '{"name": "TOOL_NAME", "parameters": {"ARG": "VALUE"}}' in tok.decode(agent.prompt_ids({"question": "q"}))
    auto = ToolAgent(None, tok, SamplingParams(), tools=["calculator"])
    assert auto.format.name == "hermes" and "<tool_call>" in tok.decode(auto.prompt_ids({"question": "q"}))


def test_cli_refuses_an_unknown_tool_format_before_loading_models(tiny_path, tmp_path, capsys):
    code = main(["train", f"model.path={tiny_path}", f"data.train.source={write_sums(tmp_path / 'd.jsonl', 4)}",
                 f"run.output_dir={tmp_path / 'runs'}", "agent.kind=tool",
                 "agent.kwargs={tools: [calculator], tool_format: pythonic}"])
    err = capsys.readouterr().err
    assert code == 2 and "agent.kwargs.tool_format: unknown tool-call format 'pythonic'" in err, err
    assert "Traceback" not in err and not (tmp_path / "runs").exists()
    with pytest.raises(InputError, match=r"agent\.kwargs\.tool_format"):  # the config check, no model needed
        _check_agent_kwargs(ToolAgent, {"tool_format": "pythonic"})
    _check_agent_kwargs(ToolAgent, {"tool_format": "mistral"})


# ---- tool results through each real template, token for token -------------------------------------------
@pytest.mark.parametrize("fixture", list(SPECS))
def test_tool_results_are_the_template_text(tiny_path, fixture):
    tok = template_tokenizer(tiny_path, fixture)
    agent = ToolAgent(None, tok, SamplingParams(), tools=["calculator"])
    ids = ["abc123XYZ", "def456UVW"]
    results = ["42", "error: unknown tool 'x'"][: 1 if fixture.startswith("llama") else 2]
    got = agent.result_ids(results, ids[: len(results)])
    msgs = agent.format.tool_messages(results, ids[: len(results)], tok.chat_template)
    assert got == continuation_ids(tok, msgs, agent._schemas)
    text = tok.decode(got)
    if agent.format.name == "mistral":  # ids of the calls, content as JSON inside the template's JSON object
        assert text == ('[TOOL_RESULTS] {"content": 42, "call_id": "abc123XYZ"}[/TOOL_RESULTS][TOOL_RESULTS] '
                        '{"content": "error: unknown tool \'x\'", "call_id": "def456UVW"}[/TOOL_RESULTS]')
    elif agent.format.name == "llama3":  # the template turns tool messages into ipython turns
        assert text == ('<|start_header_id|>ipython<|end_header_id|>\n\n"42"<|eot_id|>'
                        '<|start_header_id|>assistant<|end_header_id|>\n\n')
    else:
        assert text.startswith("\n<|im_start|>user\n<tool_response>\n42\n</tool_response>\n<tool_response>\n")


# ---- end to end on a real tiny model ---------------------------------------------------------------------
CALL_ID = "call00042"
EMITTED = {"hermes": '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>',
           "llama3": '{"name": "calculator", "parameters": {"expression": "6*7"}}',
           "mistral": "[TOOL_CALLS] [" + json.dumps({**CALC, "id": CALL_ID}) + "]"}


def run_agent(tiny_path: str, tok, emitted: list[int], extra_eos: tuple[int, ...] = ()):
    """Teach the tiny model (vocabulary grown to the template's tokens) to emit `emitted`, then run a sample."""
    model = load_model(tiny_path)
    model.resize_token_embeddings(len(tok))
    engine = LocalEngine(model, eos_token_ids=[tok.eos_token_id, *extra_eos], max_batch_size=2)
    agent = ToolAgent(RolloutController([engine]), tok, SamplingParams(max_new_tokens=96, temperature=0), None,
                      tools=["calculator"], max_turns=2)
    row = {"question": "What is 6 times 7?"}
    prompt = agent.prompt_ids(row)
    memorize(model, prompt, emitted)
    try:
        return agent, prompt, asyncio.run(agent.generate_sample(Sample(prompt_ids=[0], data=row)))
    finally:
        engine.close()


@pytest.mark.parametrize("fixture", ["qwen2.5-instruct", "llama-3.1-instruct", "mistral-7b-instruct-v0.3"])
def test_round_trip_is_the_template_conversation(tiny_path, fixture):
    tok = template_tokenizer(tiny_path, fixture)
    name = detect_format(tok.chat_template)[0]
    emitted = tok(EMITTED[name], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    agent, prompt, s = run_agent(tiny_path, tok, emitted)
    assert s.prompt_ids == prompt and s.response_ids[: s.turns[0].end] == emitted
    assert s.metrics["tool_calls"] == 1 and s.metrics["tool_errors"] == 0 and len(s.turns) == 2
    tool_ids = s.response_ids[s.turns[0].end: s.turns[1].start]
    assert set(s.loss_mask[s.turns[0].end: s.turns[1].start]) == {0}
    assert set(s.versions[s.turns[0].end: s.turns[1].start]) == {NO_VERSION}
    # the whole trajectory up to the second turn is, token for token, the template's rendering of the conversation
    call = {"id": CALL_ID, "type": "function", "function": {"name": "calculator", "arguments": {"expression": "6*7"}}}
    conversation = [{"role": "user", "content": "What is 6 times 7?" + agent.instruction},
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": CALL_ID, "content": "42"}]
    text = tok.apply_chat_template(conversation, tools=agent._schemas, tokenize=False, add_generation_prompt=True)
    assert prompt + emitted + tool_ids == tok(text, add_special_tokens=False)["input_ids"]
    assert "42" in tok.decode(tool_ids) and (name != "mistral" or CALL_ID in tok.decode(tool_ids))


def test_llama3_python_tag_call_ending_in_eom(tiny_path):
    """`<|python_tag|>{...}<|eom_id|>`: the call parses, and eom ends the turn (no eot is added after it)."""
    tok = template_tokenizer(tiny_path, "llama-3.1-instruct")
    eom = tok.convert_tokens_to_ids("<|eom_id|>")
    emitted = tok("<|python_tag|>" + EMITTED["llama3"], add_special_tokens=False)["input_ids"] + [eom]
    _, _, s = run_agent(tiny_path, tok, emitted, extra_eos=(eom,))
    assert s.response_ids[: s.turns[0].end] == emitted and s.metrics["tool_calls"] == 1
    tool_ids = s.response_ids[s.turns[0].end: s.turns[1].start]  # straight after eom: no eot added
    assert tok.decode(tool_ids) == ('<|start_header_id|>ipython<|end_header_id|>\n\n"42"<|eot_id|>'
                                    '<|start_header_id|>assistant<|end_header_id|>\n\n')
