"""Options clients send that relayrl serve (and the per-episode proxy, which shares its code) used to accept and
ignore: each is now honoured or refused with a 400 naming it. `parallel_tool_calls: false` returns one call;
OpenAI's legacy `functions` / `function_call` are refused; SGLang's `no_stop_trim` keeps the stop string in the
native API's text. On the real tokenizer and engine of the tiny model."""

import asyncio

import pytest

from relayrl.engine.base import GenOutput, SamplingParams
from relayrl.engine.local import LocalEngine
from relayrl.models import load_tokenizer
from relayrl.serve import openai_params
from relayrl.serve.chat_tools import ChatTools
from relayrl.serve.errors import BadRequest
from relayrl.serve.limits import ServerLimits
from relayrl.serve.native import generate_response
from relayrl.serve.parsing import parse_generate
from relayrl.serve.state import ServerState

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
TWO_CALLS = ('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
             '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>')
LIMITS = ServerLimits.for_engine(1024, 512, 4)


@pytest.mark.parametrize("parallel, calls", [(True, 2), (False, 1)])
def test_parallel_tool_calls_false_returns_the_first_call_only(tiny_path, parallel, calls):
    tok = load_tokenizer(tiny_path)
    tools = ChatTools(tok)
    ids = tok(TWO_CALLS, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    out = GenOutput(ids, [0.0] * len(ids), [0] * len(ids), "stop", 3)
    choice = tools.choice(None, TOOLS, parallel)
    _, got, finish = tools.reply(choice, out, tok.decode(ids, skip_special_tokens=True), (), "stop")
    assert [c["function"]["arguments"] for c in got] == ['{"a": 1}', '{"a": 2}'][:calls]
    assert finish == "tool_calls"


@pytest.mark.parametrize("body, field", [({"functions": [{"name": "add"}]}, "functions"),
                                         ({"function_call": "auto"}, "function_call"),
                                         ({"parallel_tool_calls": "yes"}, "parallel_tool_calls")])
def test_legacy_functions_and_a_malformed_parallel_flag_are_400s_naming_them(body, field):
    with pytest.raises(BadRequest) as e:
        openai_params.sampling(body, LIMITS, 5)
    assert e.value.field == field and str(e.value).startswith(field)


@pytest.mark.parametrize("no_stop_trim", [False, True])
def test_no_stop_trim_keeps_the_stop_string_in_the_native_text(tiny_path, no_stop_trim):
    tok, engine_tok = load_tokenizer(tiny_path), load_tokenizer(tiny_path)
    engine = LocalEngine.from_pretrained(tiny_path, dtype="float32", max_batch_size=2)
    try:
        prompt = tok("Hello there", add_special_tokens=False)["input_ids"]
        free = engine.generate([prompt], SamplingParams(max_new_tokens=24, seed=3, ignore_eos=True))[0]
        text = engine_tok.decode(free.output_ids, skip_special_tokens=True)
        stop = next(c for c in text[2:] if c.isascii() and c.isprintable() and not c.isspace())
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 24, "seed": 3, "ignore_eos": True,
                                                         "stop": [stop], "no_stop_trim": no_stop_trim}}
        (job,), _ = asyncio.run(parse_generate(body, LIMITS, None))
        out = engine.generate([prompt], job.params)[0]
        state = ServerState(engine, tok, tiny_path, LIMITS)
        got = generate_response(job, out, state)["text"]
    finally:
        engine.close()
    full = tok.decode(out.output_ids, skip_special_tokens=True)
    assert out.stop_string == stop and job.trim_stop is not no_stop_trim
    assert got == (full if no_stop_trim else full[:full.index(stop)])
