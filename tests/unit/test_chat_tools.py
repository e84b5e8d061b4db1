"""`relayrl.serve.chat_tools` on fixed model outputs: each chat template's tool-call format parsed into OpenAI
`tool_calls` (tokenized and decoded by the real tiny tokenizer given that template's special tokens),
`tool_choice` and `response_format` checked, and a named tool_choice's prefill. The server end to end:
tests/integration/test_serve_tools.py."""

import json
import re
from pathlib import Path

import pytest

from relayrl.engine.base import GenOutput
from relayrl.models import load_tokenizer
from relayrl.serve import openai_params
from relayrl.serve.chat_tools import ChatTools, ToolChoice, check_structured_output
from relayrl.serve.errors import BadRequest

TEMPLATES = Path(__file__).parents[1] / "fixtures" / "chat_templates"
LLAMA = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]
MISTRAL = ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
           "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]
# format -> (template fixture, its special tokens, bos, eos)
SPECS = {"hermes": ("qwen2.5-instruct", [], None, "<|im_end|>"),
         "llama3": ("llama-3.1-instruct", LLAMA, "<|begin_of_text|>", "<|eot_id|>"),
         "mistral": ("mistral-7b-instruct-v0.3", MISTRAL, "<s>", "</s>")}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                           "parameters": {"type": "object", "properties": {"a": {}, "b": {}}}}},
         {"type": "function", "function": {"name": "neg", "parameters": {"type": "object"}}}]
ADD = {"name": "add", "arguments": {"a": 1, "b": "é"}}
# format -> a turn with text, then two calls (the arguments' spacing is the model's, not JSON's canonical one)
TWO_CALLS = {"hermes": 'I will add.\n<tool_call>\n{"name": "add", "arguments": {"a":1, "b": "é"}}\n</tool_call>\n'
                       '<tool_call>{"name": "neg", "arguments": "{\\"x\\": 2}"}</tool_call>',
             "llama3": '{"name": "add", "parameters": {"a":1, "b": "é"}}; {"name": "neg", "parameters": {"x": 2}}',
             "mistral": 'I will add.[TOOL_CALLS] [{"name": "add", "arguments": {"a":1, "b": "é"}}, '
                        '{"name": "neg", "arguments": {"x": 2}}]'}
MALFORMED = {"hermes": '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call><tool_call>{"name": add}'
                       '</tool_call>',
             "llama3": '{"name": "add", "parameters": {"a": 1}}; {"name": add}',
             "mistral": '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}, {"name": add}]'}


@pytest.fixture(scope="module")
def tokenizers(tiny_path):
    """format -> the tiny tokenizer with that format's real chat template and special tokens."""
    out = {}
    for name, (fixture, specials, bos, eos) in SPECS.items():
        tok = load_tokenizer(tiny_path)
        tok.add_special_tokens({"additional_special_tokens": specials})
        if bos:
            tok.bos_token = bos
        tok.eos_token = eos
        tok.chat_template = (TEMPLATES / f"{fixture}.jinja").read_text()
        out[name] = tok
    return out


def generated(tok, text: str, end: bool = True) -> tuple[GenOutput, str]:
    """What the engine returns for a model that wrote `text` (then its end-of-turn token), and its decoded text."""
    ids = tok(text, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if end else [])
    out = GenOutput(ids, [0.0] * len(ids), [0] * len(ids), "stop" if end else "length", 5)
    return out, tok.decode(ids, skip_special_tokens=True)


def reply(tools: ChatTools, choice: ToolChoice, text: str, end: bool = True):
    out, decoded = generated(tools.tok, text, end)
    return tools.reply(choice, out, decoded, (), "stop" if end else "length")


@pytest.mark.parametrize("fmt", list(SPECS))
def test_calls_in_each_format_become_openai_tool_calls(tokenizers, fmt, caplog):
    with caplog.at_level("INFO", logger="relayrl.serve"):
        tools = ChatTools(tokenizers[fmt])
    assert tools.format.name == fmt and f"tool-call format {fmt}" in caplog.text
    content, calls, finish = reply(tools, tools.choice(None, TOOLS), TWO_CALLS[fmt])
    assert finish == "tool_calls" and content == (None if fmt == "llama3" else "I will add.")
    assert [c["function"]["name"] for c in calls] == ["add", "neg"] and {c["type"] for c in calls} == {"function"}
    # arguments: a JSON string, re-serialised from what was parsed (a string of JSON decoded first)
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [ADD["arguments"], {"x": 2}]
    assert calls[0]["function"]["arguments"] == '{"a": 1, "b": "é"}'
    ids = [c["id"] for c in calls]
    pattern = r"[A-Za-z0-9]{9}" if fmt == "mistral" else r"call_[0-9a-f]{24}"  # Mistral's templates want 9
    assert all(re.fullmatch(pattern, i) for i in ids) and len(set(ids)) == 2


@pytest.mark.parametrize("fmt", list(SPECS))
def test_malformed_or_absent_calls_stay_text(tokenizers, fmt):
    tools = ChatTools(tokenizers[fmt])
    auto = tools.choice("auto", TOOLS)
    _, text = generated(tools.tok, MALFORMED[fmt])
    assert reply(tools, auto, MALFORMED[fmt]) == (text, None, "stop")  # one bad call: the whole turn is text
    assert reply(tools, auto, "The answer is 3.", end=False) == ("The answer is 3.", None, "length")
    _, text = generated(tools.tok, TWO_CALLS[fmt])
    assert reply(tools, tools.choice("none", TOOLS), TWO_CALLS[fmt]) == (text, None, "stop")  # not parsed


def test_a_mistral_call_id_renders_back_through_the_template(tokenizers):
    """The next request carries the reply's calls and ids back; the Mistral template accepts only 9-character
    ids, and a call's own valid id is kept."""
    tools = ChatTools(tokenizers["mistral"])
    _, calls, _ = reply(tools, tools.choice(None, TOOLS), '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}, '
                        '"id": "abc123XYZ"}, {"name": "neg", "arguments": {}}]')
    assert calls[0]["id"] == "abc123XYZ"
    history = openai_params.messages([{"role": "user", "content": "1 + 2?"},
                                      {"role": "assistant", "content": None, "tool_calls": calls},
                                      *({"role": "tool", "tool_call_id": c["id"], "content": "3"} for c in calls)],
                                     None)
    text = tools.tok.apply_chat_template(history, tools=TOOLS, tokenize=False)
    assert all(c["id"] in text for c in calls)


@pytest.mark.parametrize("fmt, opening", [
    ("hermes", '<tool_call>\n{"name": "add", "arguments": '),
    ("llama3", '{"name": "add", "parameters": '),
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": '),
])
def test_named_tool_choice_prefills_the_call(tokenizers, fmt, opening):
    tools = ChatTools(tokenizers[fmt])
    choice = tools.choice({"type": "function", "function": {"name": "add"}}, TOOLS)
    assert choice == ToolChoice("named", "add", opening)
    rest = {"hermes": '{"a": 1, "b": "é"}}\n</tool_call>', "llama3": '{"a": 1, "b": "é"}}',
            "mistral": '{"a": 1, "b": "é"}}]'}[fmt]
    content, calls, finish = reply(tools, choice, rest)
    assert content is None and finish == "stop"  # as OpenAI and vLLM finish a forced call
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("add", ADD["arguments"])]
    # arguments cut short (max_tokens): no call; the turn comes back as text, its prefilled opening included
    assert reply(tools, choice, '{"a": 1, "b"', end=False) == (opening + '{"a": 1, "b"', None, "length")


@pytest.mark.parametrize("raw, message", [
    ("required", r'tool_choice: "required" needs constrained decoding.*name the function'),
    ("sometimes", r'tool_choice: must be "auto", "none", or \{"type": "function"'),
    (42, r"tool_choice: must be"),
    ({"type": "function"}, r"tool_choice: must be"),
    ({"type": "function", "function": {"name": "mul"}}, r"tool_choice: names the function 'mul', which is not "
                                                        r"among tools \(add, neg\)"),
])
def test_tool_choice_refusals_name_it(tokenizers, raw, message):
    with pytest.raises(BadRequest, match=message) as e:
        ChatTools(tokenizers["hermes"]).choice(raw, TOOLS)
    assert e.value.field == "tool_choice" and e.value.status == 400


def test_tool_choice_without_tools(tokenizers):
    tools = ChatTools(tokenizers["hermes"])
    assert tools.choice("auto", None) == tools.choice(None, None) == ToolChoice("none")
    with pytest.raises(BadRequest, match=r"tool_choice: names the function 'add'.*\(none given\)"):
        tools.choice({"type": "function", "function": {"name": "add"}}, None)


def test_tools_go_to_the_template_or_a_system_prompt(tiny_path, tokenizers):
    msgs = [{"role": "user", "content": "1 + 2?"}]
    assert ChatTools(tokenizers["hermes"]).template_inputs(msgs, TOOLS) == (msgs, {"tools": TOOLS})
    plain = ChatTools(load_tokenizer(tiny_path))  # ChatML without tool support: the system prompt tells how
    described, kw = plain.template_inputs(msgs, TOOLS)
    assert kw == {} and described[1:] == msgs and described[0]["role"] == "system"
    assert "add(a, b): Add two numbers" in described[0]["content"] and "<tool_call>" in described[0]["content"]
    assert plain.template_inputs(msgs, None) == (msgs, {})


@pytest.mark.parametrize("body, field, message", [
    ({"response_format": {"type": "json_object"}}, "response_format", "needs constrained decoding"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, "response_format",
     "needs constrained decoding"),
    ({"response_format": {"type": "xml"}}, "response_format", 'must be {"type": "text"}'),
    ({"response_format": "json"}, "response_format", 'must be {"type": "text"}'),
    ({"guided_json": {"type": "object"}}, "guided_json", "needs constrained decoding"),
    ({"structured_outputs": {"regex": "a+"}}, "structured_outputs", "needs constrained decoding"),
])
def test_structured_output_is_refused_never_ignored(body, field, message):
    with pytest.raises(BadRequest, match=re.escape(message)) as e:
        check_structured_output(body)
    assert e.value.field == field and str(e.value).startswith(f"{field}: ")


def test_text_response_format_is_accepted():
    check_structured_output({"response_format": {"type": "text"}})
    check_structured_output({})
