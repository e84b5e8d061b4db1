"""The per-episode proxy speaks `relayrl serve`'s dialects: real subprocess programs using the openai SDK send `stop`,
`top_logprobs` and streamed calls with tools (a Llama 3 chat template), and what the model is trained on is what
the engine generated. Requests serve refuses are refused by the proxy with the same 400s."""

import asyncio
import dataclasses
import json
import sys
from pathlib import Path

import httpx
import pytest
from conftest import TESTS
from engines_for_tests import memorize

from relayrl.agents import ExternalAgent
from relayrl.agents.openai_agent import Session
from relayrl.engine.base import SamplingParams
from relayrl.engine.local import LocalEngine
from relayrl.engine.rollout import RolloutController
from relayrl.engine.stops import cut_at_stop
from relayrl.models import eos_token_ids, load_model, load_tokenizer
from relayrl.sample import Sample, Status
from relayrl.scheduler.common import run_agent
from relayrl.serve.chat_tools import ChatTools

SCRIPT = Path(TESTS) / "external_agents_for_tests" / "dialects.py"
LLAMA = Path(TESTS) / "fixtures" / "chat_templates" / "llama-3.1-instruct.jinja"
LLAMA_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                "<|python_tag|>"]
QUESTION = "6*7?"
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {"x": {}}}}}]
CALL = '{"name": "calc", "parameters": {"x": "6*7"}}'  # a Llama 3 JSON tool call (short: the model learns it fast)
SAMPLED = SamplingParams(max_new_tokens=16, seed=7)  # the program sends seed 7: the same tokens as here


def run(agent: ExternalAgent, row: dict, tee: Path) -> tuple[Sample, list[dict]]:
    """One episode of `agent` (its program's stdout copied to `tee`): the sample and the program's JSON lines."""
    agent.command = ["sh", "-c", f'"$0" "$@" | tee {tee}', *agent.command]
    try:
        (s,) = asyncio.run(run_agent(agent, Sample(prompt_ids=[1], data=row, group_id="g"), 120))
    finally:
        agent.close()
    assert s.status == Status.COMPLETED, s.error
    return s, [json.loads(line) for line in tee.read_text().splitlines()]


@pytest.fixture(scope="module")
def chatml(tiny_path):
    """The tiny ChatML model in an engine that can stop on strings, and the prompt the proxy renders."""
    tok = load_tokenizer(tiny_path)
    engine_tok = load_tokenizer(tiny_path)
    engine = LocalEngine(load_model(tiny_path), eos_token_ids=eos_token_ids(tok, tiny_path), max_batch_size=4,
                         decode=lambda ids: engine_tok.decode(ids, skip_special_tokens=True))
    prompt = tok(tok.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                         add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    yield tok, engine, prompt
    engine.close()


@pytest.mark.parametrize("stream", [False, True])
def test_stop_and_top_logprobs_through_the_proxy(chatml, tmp_path, stream):
    """`stop` cuts the text the program gets before the stop string (streamed too: no delta shows it), while the
    tokens it gets and the sample trains on are the engine's, the one completing the stop string included;
    top_logprobs are the distribution's most likely tokens, the greedy token first."""
    tok, engine, prompt = chatml
    free = engine.generate([prompt], SAMPLED)[0]
    text = tok.decode(free.output_ids, skip_special_tokens=True)
    mid = len(tok.decode(free.output_ids[:4], skip_special_tokens=True))
    # a stop string the text reaches after a few tokens: whole characters (a random model writes broken UTF-8 too)
    at = next(i for i in range(mid, len(text) - 1) if text[i:i + 2].isascii() and text[i:i + 2].isprintable())
    stop = text[at: at + 2]
    want = engine.generate([prompt], dataclasses.replace(SAMPLED, stop_strings=(stop,)))[0]
    agent = ExternalAgent(RolloutController([engine]), tok, SamplingParams(max_new_tokens=16),
                          command=[sys.executable, str(SCRIPT), "stop-stream" if stream else "stop"])
    s, (got, result) = run(agent, {"question": QUESTION, "stop": stop, "seed": 7}, tmp_path / "out")
    assert result == {"reward": 1.0}
    assert want.finish_reason == "stop" and want.stop_string == stop and len(want.output_ids) < len(free.output_ids)
    assert got["finish"] == "stop" and got["content"] == cut_at_stop(text, (stop,)) and stop not in got["content"]
    assert got["token_ids"] == want.output_ids == s.response_ids  # every sampled token, the stop's own included
    assert stop in tok.decode(s.response_ids, skip_special_tokens=True)
    assert s.prompt_ids == prompt and got["logprobs"] == s.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    assert all(len(alts) == 3 for alts in got["top"]) and len(got["top"]) == len(s.response_ids)
    for lp, alts, token in zip(got["logprobs"], got["top"], s.response_ids):
        assert alts[0][1] >= alts[1][1] >= alts[2][1]  # the most likely first
        text_of = tok.decode([token])
        assert [text_of, lp] in alts or lp <= alts[2][1]  # the sampled token among them, or less likely


@pytest.fixture(scope="module")
def llama(tiny_path):
    """The tiny model with a Llama 3.1 chat template (its special tokens added), taught to answer QUESTION with
    TOOLS by a Llama 3 JSON tool call; (tokenizer, engine, prompt, the taught tokens)."""
    def tokenizer():
        tok = load_tokenizer(tiny_path)
        tok.add_special_tokens({"additional_special_tokens": LLAMA_TOKENS})
        tok.bos_token, tok.eos_token, tok.chat_template = "<|begin_of_text|>", "<|eot_id|>", LLAMA.read_text()
        return tok

    tok, engine_tok = tokenizer(), tokenizer()
    model = load_model(tiny_path)
    model.resize_token_embeddings(len(tok))
    messages, kw = ChatTools(tok).template_inputs([{"role": "user", "content": QUESTION}], TOOLS)
    prompt = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw),
                 add_special_tokens=False)["input_ids"]
    emitted = tok(CALL, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    memorize(model, prompt, emitted)
    engine = LocalEngine(model, eos_token_ids=[tok.eos_token_id], max_batch_size=4,
                         decode=lambda ids: engine_tok.decode(ids, skip_special_tokens=True))
    yield tok, engine, prompt, emitted
    engine.close()


def test_a_streamed_llama3_tool_call_and_its_result_are_one_trajectory(llama, tmp_path):
    """Streamed with tools, the program gets the Llama 3 call as OpenAI tool_call deltas (no content); it sends the
    result back, and the two calls are one token-exact trajectory: the taught call, the template's tool turn."""
    tok, engine, prompt, emitted = llama
    agent = ExternalAgent(RolloutController([engine]), tok, SamplingParams(max_new_tokens=48, temperature=0),
                          command=[sys.executable, str(SCRIPT), "tools-stream"])
    s, (got, _) = run(agent, {"question": QUESTION, "tools": TOOLS}, tmp_path / "out")
    (call,) = got["calls"]
    assert got["finish"] == "tool_calls" and got["content"] == ""
    assert call["function"]["name"] == "calc" and json.loads(call["function"]["arguments"]) == {"x": "6*7"}
    assert s.prompt_ids == prompt and s.response_ids[: s.turns[0].end] == emitted and len(s.turns) == 2
    # the second call continued the recorded tokens: prompt + the call + the template's ipython turn
    assert got["second_prompt"] == s.input_ids[: len(s.prompt_ids) + s.turns[1].start]
    assert tok.decode(got["second_prompt"][len(prompt) + len(emitted):]) == (
        '<|start_header_id|>ipython<|end_header_id|>\n\n"42"<|eot_id|><|start_header_id|>assistant'
        '<|end_header_id|>\n\n')


def call_proxy(agent: ExternalAgent, bodies: list[dict]) -> tuple[list[httpx.Response], Session]:
    """Each body posted to a fresh episode's chat completions, as a program would."""
    async def main():
        proxy, session = agent.proxy(), Session("s")
        ep = proxy.open(session, 100, 1000)
        async with httpx.AsyncClient(timeout=60) as http:
            return [await http.post(proxy.base_url(ep) + "/chat/completions", json=body,
                                    headers={"authorization": f"Bearer {ep.key}"}) for body in bodies], session

    try:
        return asyncio.run(main())
    finally:
        agent.close()


MESSAGES = [{"role": "user", "content": QUESTION}]
REFUSED = [({"response_format": {"type": "json_object"}}, "response_format"),
           ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
           ({"functions": [TOOLS[0]["function"]]}, "functions"),
           ({"function_call": "auto"}, "function_call"),
           ({"guided_json": {}}, "guided_json"),
           ({"frequency_penalty": 0.5}, "frequency_penalty"),
           ({"n": 2}, "n"),
           ({"stop": ""}, "stop"),
           ({"top_logprobs": 3}, "top_logprobs"),
           ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
           ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
           ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
           ({"messages": [{"content": "no role"}]}, "messages[0]")]


def test_what_serve_refuses_the_proxy_refuses_with_the_same_400(chatml):
    """Each refusal names its field, before anything is generated or recorded; a named tool_choice is honoured:
    its call's opening is prompt (prefilled), not generated."""
    tok, engine, prompt = chatml
    agent = ExternalAgent(RolloutController([engine]), tok, SamplingParams(max_new_tokens=4), command=["true"])
    named = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 2, "return_token_ids": True,
             "tool_choice": {"type": "function", "function": {"name": "calc"}}}
    replies, session = call_proxy(agent, [{"messages": MESSAGES, **body} for body, _ in REFUSED] + [named])
    for (body, field), r in zip(REFUSED, replies):
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (body, r.text)
        assert r.json()["error"]["message"].startswith(field)
    ok = replies[-1]
    assert ok.status_code == 200 and len(session.calls) == 1  # the refused calls recorded nothing
    opening = '<tool_call>\n{"name": "calc", "arguments": '
    assert tok.decode(ok.json()["choices"][0]["prompt_token_ids"]).endswith("<|im_start|>assistant\n" + opening)
    assert session.calls[0].prompt_ids == ok.json()["choices"][0]["prompt_token_ids"]
