"""Logprobs as clients ask for them from `relayrl serve`: top alternatives (chat `top_logprobs`, completions
`logprobs: k`), completions `echo` (prompt logprobs; `max_tokens: 0` scores the prompt alone), and SGLang's
`return_logprob` with `logprob_start_len` / `top_logprobs_num`. A real server subprocess on 127.0.0.1 with the tiny
model, the real `openai` client (sync and async), every value checked against a plain HF forward of the same model
on the same tokens."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import torch
from serve_for_tests import Server

from relayrl.models import load_model, load_tokenizer


@pytest.fixture(scope="module")
def url(tiny_path, tmp_path_factory):  # requests name the model as it is served: its --model argument
    server = Server(tiny_path, tmp_path_factory.mktemp("serve-logprobs") / "server.log")
    yield server.wait_ready()
    assert server.stop() == 0


@pytest.fixture(scope="module")
def ref(tiny_path):
    """The tokenizer and log_softmax(logits / T) of a plain forward of the same model."""
    tok, model = load_tokenizer(tiny_path), load_model(tiny_path, dtype="float32")

    def log_softmax(ids: list[int], temperature: float = 1.0) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float() / temperature, dim=-1)

    return tok, log_softmax


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def check_top(alternatives: list[tuple[str, float]], row: torch.Tensor, k: int, tok) -> None:
    """k alternatives, most likely first, equal to the reference row's top k (texts: the tokens decoded)."""
    values, ids = row.topk(k)
    got = [lp for _, lp in alternatives]
    assert len(alternatives) == k and got == sorted(got, reverse=True)
    assert got == pytest.approx(values.tolist(), abs=1e-4)
    assert [t for t, _ in alternatives] == [tok.decode([i]) for i in ids.tolist()]


def expected_dict(row: torch.Tensor, k: int, tok) -> dict[str, tuple[int, float]]:
    """The reference top k as a completions `top_logprobs` dict: text -> (id, logprob); texts that coincide (pieces
    of one character decode alike) keep the likelier, as the server's dict does."""
    values, ids = row.topk(k)
    want: dict[str, tuple[int, float]] = {}
    for i, v in zip(ids.tolist(), values.tolist()):
        want.setdefault(tok.decode([i]), (i, v))
    return want


def check_top_dict(top: dict[str, float], row: torch.Tensor, k: int, tok) -> dict[str, tuple[int, float]]:
    want = expected_dict(row, k, tok)
    assert list(top) == list(want)
    assert list(top.values()) == pytest.approx([v for _, v in want.values()], abs=1e-4)
    return want


MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


def check_chat(r, ref, k: int) -> None:
    tok, log_softmax = ref
    choice = r.choices[0]
    prompt, out = choice.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
    lsm = log_softmax(prompt + out)
    content = choice.logprobs.content
    assert [c.token for c in content] == [tok.decode([t]) for t in out]
    for j, (c, t) in enumerate(zip(content, out)):
        row = lsm[len(prompt) - 1 + j]
        assert c.logprob == pytest.approx(float(row[t]), abs=1e-4) and c.bytes == list(c.token.encode())
        check_top([(a.token, a.logprob) for a in c.top_logprobs], row, k, tok)
        assert all(a.bytes == list(a.token.encode()) for a in c.top_logprobs)
        assert c.top_logprobs[0].logprob == c.logprob  # greedy: the sampled token is the first, to the bit


def check_completion(choice, prompt: list[int], ref, k: int) -> None:
    tok, log_softmax = ref
    out = choice.model_extra["token_ids"]
    lp = choice.logprobs
    lsm = log_softmax(prompt + out)
    assert lp.tokens == [tok.decode([t]) for t in out]
    assert lp.token_logprobs == pytest.approx([float(lsm[len(prompt) - 1 + j, t]) for j, t in enumerate(out)],
                                              abs=1e-4)
    for j, top in enumerate(lp.top_logprobs):
        check_top_dict(top, lsm[len(prompt) - 1 + j], k, tok)
        assert top[lp.tokens[j]] == lp.token_logprobs[j]  # greedy: the sampled token is listed first, same value
    starts = [len(tok.decode(prompt))]
    for t in lp.tokens[:-1]:
        starts.append(starts[-1] + len(t))
    assert lp.text_offset == starts


def test_top_logprobs_through_the_sync_client(url, ref, tiny_path):
    tok, _ = ref
    r = client(url).chat.completions.create(model=tiny_path, messages=MESSAGES, max_tokens=6, temperature=0,
                                            logprobs=True, top_logprobs=4, extra_body={"return_token_ids": True})
    check_chat(r, ref, 4)
    r = client(url).chat.completions.create(model=tiny_path, messages=MESSAGES, max_tokens=6, temperature=0,
                                            logprobs=True, top_logprobs=20, extra_body={"return_token_ids": True})
    check_chat(r, ref, 20)  # OpenAI's most
    ids = tok("Let's think step by step.")["input_ids"]
    r = client(url).completions.create(model=tiny_path, prompt=ids, max_tokens=5, temperature=0, logprobs=5,
                                       extra_body={"return_token_ids": True})
    check_completion(r.choices[0], ids, ref, 5)
    zero = client(url).completions.create(model=tiny_path, prompt=ids, max_tokens=3, temperature=0, logprobs=0)
    assert zero.choices[0].logprobs.token_logprobs == pytest.approx(r.choices[0].logprobs.token_logprobs[:3])
    assert zero.choices[0].logprobs.top_logprobs == [{}, {}, {}]  # OpenAI's: no alternatives for logprobs 0
    plain = client(url).chat.completions.create(model=tiny_path, messages=MESSAGES, max_tokens=3, logprobs=True)
    assert all(c.top_logprobs == [] for c in plain.choices[0].logprobs.content)


def test_top_logprobs_through_the_async_client(url, ref, tiny_path):
    tok, log_softmax = ref
    ids = tok("The answer is")["input_ids"]

    async def both():
        aclient = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        async with aclient:
            return await asyncio.gather(
                aclient.chat.completions.create(model=tiny_path, messages=MESSAGES, max_tokens=5, temperature=0,
                                                logprobs=True, top_logprobs=3, extra_body={"return_token_ids": True}),
                aclient.completions.create(model=tiny_path, prompt=ids, max_tokens=5, temperature=0, logprobs=2,
                                           extra_body={"return_token_ids": True}),
                # sampled at a temperature: the alternatives come from the same scaled distribution
                aclient.completions.create(model=tiny_path, prompt=ids, max_tokens=8, temperature=0.8, seed=5,
                                           logprobs=5, extra_body={"return_token_ids": True}))

    chat, completion, hot = asyncio.run(both())
    check_chat(chat, ref, 3)
    check_completion(completion.choices[0], ids, ref, 2)
    out = hot.choices[0].model_extra["token_ids"]
    lsm = log_softmax(ids + out, 0.8)
    for j, (t, lp, top) in enumerate(zip(hot.choices[0].logprobs.tokens, hot.choices[0].logprobs.token_logprobs,
                                         hot.choices[0].logprobs.top_logprobs)):
        want = check_top_dict(top, lsm[len(ids) - 1 + j], 5, tok)  # the T-scaled distribution's top 5
        assert lp == pytest.approx(float(lsm[len(ids) - 1 + j, out[j]]), abs=1e-4)
        if want.get(t, (None,))[0] == out[j]:  # sampled and listed under its own text: the same value
            assert top[t] == lp


def test_echo_scores_the_prompt(url, ref, tiny_path):
    tok, log_softmax = ref
    text = "So Betty has 42 apples in total."
    ids = tok(text)["input_ids"]
    lsm = log_softmax(ids)
    prompt_lps = [float(lsm[i - 1, ids[i]]) for i in range(1, len(ids))]
    # what lm-eval's loglikelihood sends: echo, no new tokens, the top alternative
    r = client(url).completions.create(model=tiny_path, prompt=text, max_tokens=0, echo=True, logprobs=1, temperature=0)
    choice = r.choices[0]
    assert choice.text == text and choice.finish_reason == "length" and r.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.tokens == [tok.decode([t]) for t in ids] and lp.text_offset[0] == 0
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing comes before the first token
    assert lp.token_logprobs[1:] == pytest.approx(prompt_lps, abs=1e-4)
    for i, top in enumerate(lp.top_logprobs[1:], start=1):
        check_top_dict(top, lsm[i - 1], 1, tok)
    # a batch of token-id prompts, echoed with new tokens after them
    other = tok("How many apples")["input_ids"]
    r = client(url).completions.create(model=tiny_path, prompt=[ids, other], max_tokens=3, echo=True, logprobs=0,
                                       temperature=0, extra_body={"return_token_ids": True})
    first, second = r.choices
    out = first.model_extra["token_ids"]
    assert first.text == tok.decode(ids) + tok.decode(out, skip_special_tokens=True)
    full = log_softmax(ids + out)
    assert first.logprobs.token_logprobs[0] is None
    assert first.logprobs.token_logprobs[1:] == pytest.approx(
        [float(full[i - 1, t]) for i, t in enumerate(ids + out) if i], abs=1e-4)
    assert len(second.logprobs.tokens) == len(other) + len(second.model_extra["token_ids"])
    assert second.logprobs.top_logprobs[1:] == [{}] * (len(second.logprobs.tokens) - 1)
    # echo without logprobs: the prompt comes back, nothing is scored
    bare = client(url).completions.create(model=tiny_path, prompt=text, max_tokens=2, echo=True, temperature=0)
    assert bare.choices[0].text.startswith(text) and bare.choices[0].logprobs is None


def native(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/generate", json=body, timeout=60)


def test_native_return_logprob_fields(url, ref):
    tok, log_softmax = ref
    ids = tok("Natalia sold 48 clips in April")["input_ids"]
    r = native(url, {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
                     "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    assert r.status_code == 200, r.text
    got = r.json()
    meta, out = got["meta_info"], got["output_ids"]
    lsm = log_softmax(ids + out)
    inputs = meta["input_token_logprobs"]
    assert [t for _, t, _ in inputs] == ids and [s for _, _, s in inputs] == [tok.decode([t]) for t in ids]
    assert inputs[0][0] is None and meta["input_top_logprobs"][0] is None
    assert [lp for lp, _, _ in inputs[1:]] == pytest.approx([float(lsm[i - 1, ids[i]]) for i in range(1, len(ids))],
                                                            abs=1e-4)
    for i, top in enumerate(meta["input_top_logprobs"][1:], start=1):
        check_top([(s, lp) for lp, _, s in top], lsm[i - 1], 2, tok)
        assert [t for _, t, _ in top] == lsm[i - 1].topk(2).indices.tolist()
    outputs = meta["output_token_logprobs"]
    assert [t for _, t, _ in outputs] == out and len(meta["output_top_logprobs"]) == 3
    for j, (top, (lp, t, _)) in enumerate(zip(meta["output_top_logprobs"], outputs)):
        check_top([(s, v) for v, _, s in top], lsm[len(ids) - 1 + j], 2, tok)
        assert top[0][:2] == [lp, t]  # greedy: the sampled token first, the same value
    # from token 3 on, no text; -1 (SGLang's default): none of the prompt; no top: no top fields
    r = native(url, {"input_ids": [ids, ids[:4]], "return_logprob": True, "logprob_start_len": [3, -1],
                     "sampling_params": {"max_new_tokens": 2, "temperature": 0}}).json()
    assert [[t, s] for _, t, s in r[0]["meta_info"]["input_token_logprobs"]] == [[t, None] for t in ids[3:]]
    assert r[0]["meta_info"]["input_token_logprobs"][0][0] == pytest.approx(float(lsm[2, ids[3]]), abs=1e-4)
    assert r[1]["meta_info"]["input_token_logprobs"] == [] and "input_top_logprobs" not in r[1]["meta_info"]
    # max_new_tokens 0 with prompt logprobs: the prompt is scored, nothing generated (what lm-eval asks)
    r = native(url, {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 1,
                     "sampling_params": {"max_new_tokens": 0}}).json()
    assert r["output_ids"] == [] and r["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert [lp for lp, _, _ in r["meta_info"]["input_token_logprobs"][1:]] == pytest.approx(
        [lp for lp, _, _ in inputs[1:]], abs=1e-6)
    assert r["meta_info"]["output_token_logprobs"] == [] and r["meta_info"]["output_top_logprobs"] == []


CHAT = {"messages": MESSAGES, "max_tokens": 2}
DONE = {"prompt": "hi", "max_tokens": 2}
GEN = {"input_ids": [5, 6, 7], "return_logprob": True}
BAD = [
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": "3"}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": "yes"}, "logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "echo": True}, "echo"),
    ("/v1/completions", {**DONE, "logprobs": 6}, "logprobs"),
    ("/v1/completions", {**DONE, "logprobs": -1}, "logprobs"),
    ("/v1/completions", {**DONE, "logprobs": 1.5}, "logprobs"),
    ("/v1/completions", {**DONE, "logprobs": "1"}, "logprobs"),
    ("/v1/completions", {**DONE, "echo": "yes"}, "echo"),
    ("/v1/completions", {**DONE, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0, "logprobs": 1}, "max_tokens"),  # 0 only with echo
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1, "echo": True}, "max_tokens"),
    ("/generate", {**GEN, "logprob_start_len": 3}, "logprob_start_len"),  # past the prompt's last token
    ("/generate", {**GEN, "logprob_start_len": -2}, "logprob_start_len"),
    ("/generate", {**GEN, "logprob_start_len": "0"}, "logprob_start_len"),
    ("/generate", {"input_ids": [[5, 6], [7]], "logprob_start_len": [0]}, "logprob_start_len"),
    ("/generate", {**GEN, "top_logprobs_num": 21}, "top_logprobs_num"),
    ("/generate", {**GEN, "top_logprobs_num": 1.5}, "top_logprobs_num"),
    ("/generate", {**GEN, "return_text_in_logprobs": "yes"}, "return_text_in_logprobs"),
    ("/generate", {**GEN, "token_ids_logprob": [1]}, "token_ids_logprob"),
    ("/generate", {**GEN, "sampling_params": {"max_new_tokens": 0}}, "max_new_tokens"),  # no prompt logprobs asked
    ("/generate", {"input_ids": [5, 6], "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 0}},
     "max_new_tokens"),  # nor without return_logprob
]


def test_bad_logprob_requests_are_400_naming_the_field(url):
    for path, body, field in BAD:
        r = httpx.post(url + path, json=body, timeout=60)
        assert r.status_code == 400, (path, body, r.text)
        assert field in r.json()["error"]["message"], (path, body, r.text)
        assert "Traceback" not in r.text
    assert httpx.get(url + "/health_generate", timeout=60).status_code == 200
