"""Streaming (`stream: true`) on a real `relayrl serve` (the tiny model, 127.0.0.1, real HTTP, the openai SDK).

A seeded sample is the same tokens however it is batched, so a streamed request and the same request unstreamed
give the same answer: the joined deltas must equal the non-streamed text (and logprobs, token ids, usage). Stop
strings are picked from a reference text as tests/integration/test_serve_stop.py does. The incremental
detokenizer is checked on its own with the tiny tokenizer (a character whose bytes span several tokens).
"""

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
from bounds import bound
from serve_for_tests import Server
from stops_for_tests import find_stop

from relayrl.models import load_tokenizer
from relayrl.serve.streaming import IncrementalText

PROMPT = "Once upon a time there was"
CHAT = [{"role": "user", "content": "Tell me a story about a fox."}]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                           "parameters": {"type": "object", "properties": {"a": {}, "b": {}}}}}]
N = 40
SAMPLE = {"temperature": 1.0, "seed": 5, "max_tokens": N}
EXTRA = {"ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def url(tiny_path, tmp_path_factory):
    server = Server(tiny_path, tmp_path_factory.mktemp("serve") / "stream.log", "--served-model-name", "tiny")
    try:
        yield server.wait_ready()
    finally:
        assert server.stop() == 0


@pytest.fixture(scope="module")
def tok(tiny_path):
    return load_tokenizer(tiny_path)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def chat_chunks(url: str, **kw) -> list:
    return list(client(url).chat.completions.create(model="tiny", messages=CHAT, stream=True, **{**SAMPLE, **kw}))


def joined(chunks: list, index: int = 0) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == index)


def test_chat_stream_equals_the_answer_with_tools(url):
    plain = client(url).chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, extra_body=EXTRA, **SAMPLE)
    chunks = chat_chunks(url, tools=TOOLS, extra_body=EXTRA)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3  # pieces, not one lump
    assert joined(chunks) == (plain.choices[0].message.content or "")
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason
    assert [c for c in chunks[:-1] if c.choices[0].finish_reason] == []
    ids = [t for c in chunks for t in (c.choices[0].model_extra or {}).get("token_ids") or []]
    assert ids == plain.choices[0].model_extra["token_ids"]
    assert len({c.id for c in chunks}) == 1


def test_completion_stream_equals_the_answer(url):
    plain = client(url).completions.create(model="tiny", prompt=PROMPT, extra_body=EXTRA, **SAMPLE)
    chunks = list(client(url).completions.create(model="tiny", prompt=PROMPT, stream=True, extra_body=EXTRA,
                                                 **SAMPLE))
    assert chunks[0].object == "text_completion"
    assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason == "length"
    assert chunks[0].choices[0].model_extra["prompt_token_ids"] == plain.choices[0].model_extra["prompt_token_ids"]


def test_async_clients_stream(url):
    async def run() -> tuple[str, str, str, str]:
        aclient = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        chat = await aclient.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, stream=True, **SAMPLE)
        chat_text = "".join([c.choices[0].delta.content or "" async for c in chat])
        comp = await aclient.completions.create(model="tiny", prompt=PROMPT, stream=True, **SAMPLE)
        comp_text = "".join([c.choices[0].text async for c in comp])
        plain_chat = await aclient.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, **SAMPLE)
        plain_comp = await aclient.completions.create(model="tiny", prompt=PROMPT, **SAMPLE)
        return chat_text, plain_chat.choices[0].message.content or "", comp_text, plain_comp.choices[0].text

    chat_text, chat_want, comp_text, comp_want = asyncio.run(run())
    assert chat_text == chat_want and comp_text == comp_want


def test_include_usage_and_n(url):
    plain = client(url).chat.completions.create(model="tiny", messages=CHAT, n=2, extra_body=EXTRA, **SAMPLE)
    chunks = chat_chunks(url, n=2, stream_options={"include_usage": True}, extra_body=EXTRA)
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == plain.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])
    indices = [c.choices[0].index for c in chunks[:-1]]
    assert set(indices) == {0, 1} and indices != sorted(indices)  # interleaved as the tokens come
    for i in (0, 1):
        assert joined(chunks, i) == plain.choices[i].message.content
    finishes = [c.choices[0] for c in chunks[:-1] if c.choices[0].finish_reason]
    assert sorted(f.index for f in finishes) == [0, 1]


def test_logprobs_in_chunks(url):
    plain = client(url).chat.completions.create(model="tiny", messages=CHAT, logprobs=True, top_logprobs=2,
                                                extra_body=EXTRA, **SAMPLE)
    chunks = chat_chunks(url, logprobs=True, top_logprobs=2, extra_body=EXTRA)
    got = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    want = plain.choices[0].logprobs.content
    assert [t.token for t in got] == [t.token for t in want]
    assert [t.logprob for t in got] == pytest.approx([t.logprob for t in want], abs=1e-5)
    assert [[a.token for a in t.top_logprobs] for t in got] == [[a.token for a in t.top_logprobs] for t in want]
    comp = client(url).completions.create(model="tiny", prompt=PROMPT, logprobs=2, **SAMPLE).choices[0].logprobs
    parts = [c.choices[0].logprobs for c in client(url).completions.create(
        model="tiny", prompt=PROMPT, logprobs=2, stream=True, **SAMPLE) if c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == comp.tokens
    assert [o for p in parts for o in p.text_offset] == comp.text_offset


def test_a_stop_string_never_shows(url, tok):
    ref = client(url).completions.create(model="tiny", prompt=PROMPT, extra_body=EXTRA, **SAMPLE).choices[0]
    for span, inside in ((1, False), (3, True)):
        stop = find_stop(tok, ref.model_extra["token_ids"], span, inside)
        chunks = list(client(url).completions.create(model="tiny", prompt=PROMPT, stream=True, stop=stop.text,
                                                     extra_body=EXTRA, **SAMPLE))
        pieces = [c.choices[0].text for c in chunks]
        assert "".join(pieces) == stop.expected_text and chunks[-1].choices[0].finish_reason == "stop"
        assert not any(stop.text in p for p in pieces) and stop.text not in "".join(pieces)


def test_incremental_text_holds_split_characters_and_stop_prefixes(tok):
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    text = "fox 🦊 and 猫 went"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert any("\ufffd" in decode([t]) for t in ids)  # some character's bytes span several tokens
    inc = IncrementalText(decode)
    pieces = [inc.push(t) for t in ids]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    inc = IncrementalText(decode, ("猫 w",))
    pieces = [inc.push(t) for t in ids]
    assert "".join(pieces) == "fox 🦊 and " and inc.finish("fox 🦊 and ") == ""


def sse_lines(r: httpx.Response):
    for line in r.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def load(url: str) -> int:
    return httpx.get(url + "/get_load", timeout=10).json()[0]["num_reqs"]


def test_slow_and_vanishing_clients(url):
    """A client that reads a chunk and stops reading holds up nobody; one that hangs up frees its slots at once. The
    stream asks for 32 samples of 1000 tokens, over 10 s of the tiny model's generation on an idle machine: its
    slots must be free long before the generation would have ended."""
    body = {"prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True, "n": 32, "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_lines(r)  # kept: a dropped iterator closes the response (a disconnect)
        next(events)
        t0 = time.monotonic()
        other = client(url).completions.create(model="tiny", prompt=PROMPT, max_tokens=8)
        assert other.choices[0].finish_reason and time.monotonic() - t0 < bound(3)
        assert load(url) == 32  # the unread stream still generates
    t0 = time.monotonic()
    while load(url) and time.monotonic() - t0 < bound(10):
        time.sleep(0.05)
    assert load(url) == 0 and time.monotonic() - t0 < bound(1.5), time.monotonic() - t0


def test_chunks_arrive_while_generating(url):
    body = {"model": "tiny", "messages": CHAT, "stream": True, "max_tokens": 400, "ignore_eos": True}
    stamps: list[float] = []
    t0 = time.monotonic()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        for _ in sse_lines(r):
            stamps.append(time.monotonic() - t0)
    assert len(stamps) > 100 and stamps[1] < stamps[-1] / 4


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/chat/completions", {"messages": CHAT, "temperature": -1}, "temperature"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "stream_options": {"include_usage": "yes"}}, "include_usage"),
    ("/v1/chat/completions", {"messages": CHAT, "stream_options": []}, "stream_options"),
    ("/v1/completions", {"prompt": PROMPT, "echo": True}, "echo"),
    ("/v1/completions", {"prompt": PROMPT, "n": 10_000}, "n"),
])
def test_bad_streams_are_400_before_streaming(url, path, body, field):
    r = httpx.post(url + path, json={"model": "tiny", "stream": True, **body}, timeout=60)
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json"), r.text
    assert field in r.json()["error"]["message"]


def test_stream_options_need_stream(url):
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "stream_options": {"include_usage": True}},
                   timeout=60)
    assert r.status_code == 400 and "stream_options" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "stream": "yes"}, timeout=60)
    assert r.status_code == 400 and "stream" in r.json()["error"]["message"]


def test_concurrent_streams_do_not_mix(url):
    """Several streams at once (one continuous batch): each gets exactly its own answer."""
    want = [client(url).completions.create(model="tiny", prompt=PROMPT, seed=s, max_tokens=20).choices[0].text
            for s in range(3)]
    got: dict[int, str] = {}

    def run(s: int) -> None:
        chunks = client(url).completions.create(model="tiny", prompt=PROMPT, seed=s, max_tokens=20, stream=True)
        got[s] = "".join(c.choices[0].text for c in chunks)

    threads = [threading.Thread(target=run, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(bound(60))
    assert [got.get(s) for s in range(3)] == want


def test_an_error_mid_stream_is_an_error_event(tok):
    """A sample that fails after its first tokens: the stream ends with OpenAI's error event, no [DONE], and the
    server's fault is told by request id only."""
    from relayrl.engine.base import SamplingParams
    from relayrl.serve.streaming import Answer, ChatChunks, Choice, Stream

    async def run() -> list[str]:
        decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
        answer = Answer(lambda ids: [decode([t]) for t in ids], lambda alts: [])
        chunks = ChatChunks(answer, lambda out, params: ("", None, "stop"))
        choice = Choice(0, [1, 2], SamplingParams(), IncrementalText(decode))
        stream = Stream("chatcmpl-x", "tiny", chunks, [choice], None, 2)
        failing = asyncio.get_running_loop().create_future()
        stream.start([failing])
        events = stream.events()
        got = [await anext(events)]  # the role
        for t in tok("hello there", add_special_tokens=False)["input_ids"]:
            stream.listener(0)(t, -0.5, None)
        got.append(await anext(events))
        failing.set_exception(RuntimeError("/secret/path exploded"))
        got += [e async for e in events]
        return got

    events = asyncio.run(run())
    pieces = [json.loads(e[6:])["choices"][0]["delta"]["content"] for e in events[1:-1]]
    assert "".join(pieces) == "hello there" and len(pieces) > 1
    error = json.loads(events[-1][6:])["error"]
    assert error["type"] == "server_error" and "request id" in error["message"] and "secret" not in events[-1]
    assert "[DONE]" not in "".join(events)


def test_the_engine_hands_out_each_token_and_the_output_is_unchanged(tiny_path):
    """LocalEngine's on_token: every token, logprob and alternative as sampled, in order; the GenOutput the same as
    without a listener; a listener that raises is dropped and its request still finishes whole."""
    from relayrl.engine.base import SamplingParams
    from relayrl.engine.local import LocalEngine

    engine = LocalEngine.from_pretrained(tiny_path, dtype="float32")
    try:
        params = SamplingParams(max_new_tokens=30, seed=7, ignore_eos=True, top_logprobs=2)
        plain = engine.submit([5, 6, 7], params).result()
        seen: list = []
        streamed = engine.submit([5, 6, 7], params, on_token=lambda *t: seen.append(t)).result()

        def broken(*_):
            raise RuntimeError("listener bug")

        survived = engine.submit([5, 6, 7], params, on_token=broken).result()
    finally:
        engine.close()
    assert streamed == plain == survived
    assert seen == list(zip(plain.output_ids, plain.logprobs, plain.top_logprobs))
