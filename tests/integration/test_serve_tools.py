"""`relayrl serve` with tools, end to end: a real server subprocess, the real `openai` client, no mocks.

A random tiny model never writes a tool call by itself, so it is taught (real optimizer steps, `teach`) two
answers and saved as the served folder: for ASK, a sentence then a Hermes call (its ChatML template has no tool
support, so the server describes the tools and the Hermes format in a system prompt); for NAMED, after the
prefilled opening of a call to `add` that a named tool_choice puts in the prompt, the call's arguments. Parsing of
each format on fixed texts: tests/unit/test_chat_tools.py.
"""

import json

import httpx
import openai
import pytest
import torch
from openai.types.chat import ChatCompletionMessageToolCall
from serve_for_tests import Server

from relayrl.models import eos_token_ids, load_model, load_tokenizer, save_pretrained_atomic
from relayrl.serve.chat_tools import ChatTools

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                           "parameters": {"type": "object", "properties": {"a": {}, "b": {}}}}}]
ASK = [{"role": "user", "content": "What is 1 + 2?"}]
NAMED = [{"role": "user", "content": "Add 3 and 4."}]
CALL = 'I will add.\n<tool_call>{"name": "add", "arguments": {"a":1, "b":2}}</tool_call>'
ARGS = '{"a": 3, "b": 4}}\n</tool_call>'
ADD = {"type": "function", "function": {"name": "add"}}


def prompt_ids(tok, tools: ChatTools, messages: list[dict], prefill: str = "") -> list[int]:
    """The prompt the server renders: the template's text with the tools, then the prefill."""
    msgs, kw = tools.template_inputs(messages, TOOLS)
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kw)
    return tok(text + prefill, add_special_tokens=False)["input_ids"]


def teach(model, pairs: list[tuple[list[int], list[int]]], steps: int = 600) -> None:
    """engines_for_tests.memorize for several (prompt, target) pairs at once: taught one after the other, a
    tiny model unlearns the first; here every step trains on all, until greedy decoding gives each target."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        losses, learnt = [], True
        for prompt, target in pairs:
            ids = torch.tensor([prompt + target])
            logits = model(ids).logits[0, len(prompt) - 1: -1]
            learnt &= bool((logits.argmax(-1) == ids[0, len(prompt):]).all()) and \
                logits.softmax(-1).max(-1).values.min().item() > 0.9
            losses.append(torch.nn.functional.cross_entropy(logits, ids[0, len(prompt):]))
        if learnt:
            break
        opt.zero_grad()
        sum(losses).backward()
        opt.step()
    model.eval()


@pytest.fixture(scope="module")
def taught(tiny_path, tmp_path_factory):
    """(served folder, prompts, what the model was taught to generate after each, eos included)."""
    tok = load_tokenizer(tiny_path)
    model = load_model(tiny_path, dtype="float32")
    tools = ChatTools(tok)
    eos = eos_token_ids(tok, tiny_path)[0]
    prompts = {"auto": prompt_ids(tok, tools, ASK),
               "named": prompt_ids(tok, tools, NAMED, tools.choice(ADD, TOOLS).prefill)}
    targets = {"auto": tok(CALL, add_special_tokens=False)["input_ids"] + [eos],
               "named": tok(ARGS, add_special_tokens=False)["input_ids"] + [eos]}
    teach(model, [(prompts[key], targets[key]) for key in prompts])
    folder = save_pretrained_atomic(model, tok, tmp_path_factory.mktemp("taught") / "model")
    return str(folder), prompts, targets


@pytest.fixture(scope="module")
def server(taught, tmp_path_factory):
    s = Server(taught[0], tmp_path_factory.mktemp("serve") / "server.log", "--served-model-name", "tiny",
               "--log-level", "info")
    s.wait_ready()
    yield s
    assert s.stop() == 0


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def chat(server: Server, messages: list[dict], **kw):
    kw = {"tools": TOOLS, "temperature": 0, "max_tokens": 96, "extra_body": {"return_token_ids": True}, **kw}
    return client(server).chat.completions.create(model="tiny", messages=messages, **kw)


def test_a_call_in_the_output_is_a_typed_tool_call(server, taught):
    _, prompts, targets = taught
    choice = chat(server, ASK).choices[0]
    assert choice.model_extra["prompt_token_ids"] == prompts["auto"]
    assert choice.model_extra["token_ids"] == targets["auto"]  # the model wrote the call it was taught
    assert choice.finish_reason == "tool_calls" and choice.message.content == "I will add."
    (call,) = choice.message.tool_calls
    assert isinstance(call, ChatCompletionMessageToolCall) and call.type == "function"
    assert call.id.startswith("call_") and call.function.name == "add"
    assert call.function.arguments == '{"a": 1, "b": 2}'  # re-serialised JSON
    # the conversation goes on with the call and its result, as an agent sends it
    history = [*ASK, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "3"}]
    nxt = client(server).chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=4,
                                                 extra_body={"return_token_ids": True})
    rendered = load_tokenizer(taught[0]).decode(nxt.choices[0].model_extra["prompt_token_ids"])
    assert rendered.endswith("<|im_start|>assistant\nI will add.<|im_end|>\n<|im_start|>tool\n3<|im_end|>\n"
                             "<|im_start|>assistant\n")  # ChatML without tool support shows the content only
    # chosen once at start and said at INFO, once, whatever the number of requests
    assert server.log.read_text().count("tool-call format hermes") == 1


def test_tool_choice_none_renders_the_tools_and_parses_nothing(server, taught):
    _, prompts, targets = taught
    choice = chat(server, ASK, tool_choice="none").choices[0]
    assert choice.model_extra["prompt_token_ids"] == prompts["auto"]  # tools still in the prompt (vLLM's way)
    assert choice.model_extra["token_ids"] == targets["auto"]
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert choice.message.content == CALL


def test_named_tool_choice_prefills_the_call(server, taught):
    _, prompts, targets = taught
    r = chat(server, NAMED, tool_choice=ADD, logprobs=True)
    choice = r.choices[0]
    # the prefilled opening is prompt; only what the model wrote after it is generated, with its logprobs
    assert choice.model_extra["prompt_token_ids"] == prompts["named"]
    assert load_tokenizer(taught[0]).decode(prompts["named"]).endswith('<tool_call>\n{"name": "add", "arguments": ')
    assert choice.model_extra["token_ids"] == targets["named"]
    assert len(choice.logprobs.content) == len(targets["named"]) == r.usage.completion_tokens
    assert choice.message.content is None and choice.finish_reason == "stop"  # a forced call, as OpenAI ends it
    (call,) = choice.message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 3, "b": 4}
    # cut before the arguments are whole: no call, the turn as text
    short = chat(server, NAMED, tool_choice=ADD, max_tokens=3).choices[0]
    assert short.message.tool_calls is None and short.finish_reason == "length"
    assert short.message.content.startswith('<tool_call>\n{"name": "add", "arguments": {')


@pytest.mark.parametrize("kw, param, message", [
    ({"tool_choice": "required"}, "tool_choice", '"required" needs constrained decoding'),
    ({"tool_choice": {"type": "function", "function": {"name": "mul"}}}, "tool_choice", "'mul', which is not among"),
    ({"tool_choice": "sometimes"}, "tool_choice", "must be"),
    ({"response_format": {"type": "json_object"}}, "response_format", "needs constrained decoding"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}}},
     "response_format", "needs constrained decoding"),
    ({"extra_body": {"guided_json": {"type": "object"}}}, "guided_json", "needs constrained decoding"),
])
def test_what_cannot_be_honoured_is_refused(server, kw, param, message):
    with pytest.raises(openai.BadRequestError, match=message) as e:
        client(server).chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=4, **kw)
    assert e.value.param == param and e.value.status_code == 400


def test_text_response_format_is_served_and_completions_refuse_json(server):
    r = client(server).chat.completions.create(model="tiny", messages=ASK, max_tokens=4,
                                               response_format={"type": "text"})
    assert r.choices[0].finish_reason in ("stop", "length")
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4,
                                                          "response_format": {"type": "json_object"}}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
