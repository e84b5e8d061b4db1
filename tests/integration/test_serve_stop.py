"""Stop strings and model names on a real `relayrl serve` (the tiny model, 127.0.0.1, real HTTP, the openai SDK).

A random model's text is not known in advance: each test generates once without stops (a seeded sample: the tiny
model, greedy, repeats one token), picks a piece of that text as the stop string (tests/stops_for_tests.py) and
checks that the same request with it ends at the token that completes it: the same tokens up to there (token_ids
keep the completing token), the text cut right before the stop string, finish_reason "stop". The engine side:
tests/unit/test_stop_strings.py.
"""

import httpx
import openai
import pytest
from serve_for_tests import Server
from stops_for_tests import find_stop, first_hit

from relayrl.models import load_tokenizer

NAMES = ("tiny-a", "tiny-b")
PROMPT = "Once upon a time there was"
CHAT = [{"role": "user", "content": "Tell me a story about a fox."}]
N = 48
SEED = 3
SAMPLE = {"temperature": 1.0, "seed": SEED, "max_tokens": N, "ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def url(tiny_path, tmp_path_factory):
    server = Server(tiny_path, tmp_path_factory.mktemp("serve") / "stop.log", "--served-model-name", *NAMES)
    try:
        yield server.wait_ready()
    finally:
        assert server.stop() == 0


@pytest.fixture(scope="module")
def tok(tiny_path):
    return load_tokenizer(tiny_path)


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def complete(url: str, **body) -> dict:
    r = post(url, "/v1/completions", {"model": NAMES[0], "prompt": PROMPT, **SAMPLE, **body})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def reference(url) -> dict:
    """The completion's seeded choice without stops (token ids and text): what the stop tests cut."""
    return complete(url)["choices"][0]


@pytest.mark.parametrize(("span", "inside"), [(1, False), (2, False), (3, False), (1, True), (3, True)])
def test_completion_ends_at_the_stop(url, tok, reference, span, inside):
    """Within one token, across 2-3 token boundaries, ending inside a token; `stop` as a string and a list."""
    stop = find_stop(tok, reference["token_ids"], span, inside)
    choice = complete(url, stop=[stop.text] if span > 1 else stop.text)["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == stop.expected_text and stop.text not in choice["text"]
    assert choice["token_ids"] == reference["token_ids"][:stop.last + 1]  # the completing token kept


def test_greedy_with_and_without_a_stop_share_the_prefix(url, tok):
    ref = complete(url, temperature=0)["choices"][0]
    stop = find_stop(tok, ref["token_ids"], 2, True, skip=0)
    choice = complete(url, temperature=0, stop=stop.text)["choices"][0]
    assert choice["token_ids"] == ref["token_ids"][:stop.last + 1] and choice["text"] == stop.expected_text


def test_several_stops_the_earliest_wins(url, tok, reference):
    ids = reference["token_ids"]
    a, b = find_stop(tok, ids, 2, False), find_stop(tok, ids, 1, False, skip=20)
    early, late = (a, b) if a.last < b.last else (b, a)
    assert early.last < late.last
    choice = complete(url, stop=[late.text, "\u2603 never", early.text])["choices"][0]
    assert choice["text"] == early.expected_text
    assert choice["token_ids"] == ids[:early.last + 1]


def test_chat_ends_at_the_stop(url, tok):
    body = {"model": NAMES[1], "messages": CHAT, **SAMPLE}
    ref = post(url, "/v1/chat/completions", body).json()["choices"][0]
    stop = find_stop(tok, ref["token_ids"], 2, True)
    choice = post(url, "/v1/chat/completions", {**body, "stop": [stop.text]}).json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == stop.expected_text
    assert choice["token_ids"] == ref["token_ids"][:stop.last + 1]


def test_native_generate_ends_at_the_stop(url, tok, reference):
    """The same prompt ids and seed as the completion: the same tokens, cut at the stop."""
    stop = find_stop(tok, reference["token_ids"], 3, False)
    sp = {"temperature": 1.0, "seed": SEED, "max_new_tokens": N, "ignore_eos": True, "stop": [stop.text]}
    r = post(url, "/generate", {"input_ids": reference["prompt_token_ids"], "sampling_params": sp,
                                "return_logprob": True})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop.text}
    assert out["text"] == stop.expected_text
    assert out["output_ids"] == reference["token_ids"][:stop.last + 1]
    assert len(out["meta_info"]["output_token_logprobs"]) == stop.last + 1  # a logprob for every token kept


def test_each_of_n_choices_stops_on_its_own(url, tok):
    """n seeded samples: a stop string taken from the first one ends each choice where its own text holds it."""
    body = {"temperature": 1.0, "seed": 11, "n": 3, "max_tokens": N, "ignore_eos": True, "return_token_ids": True}
    ref = complete(url, **body)["choices"]
    stop = find_stop(tok, ref[0]["token_ids"], 1, False, skip=10)
    got = complete(url, **body, stop=stop.text)["choices"]
    ends = []
    for r, g in zip(ref, got):
        hit = first_hit(tok, r["token_ids"], stop.text)
        want = r["token_ids"] if hit is None else r["token_ids"][:hit.last + 1]
        assert g["token_ids"] == want
        assert g["finish_reason"] == ("length" if hit is None else "stop")
        ends.append(len(want))
    assert len(set(ends)) > 1, ends  # each choice ended at its own place, not at the first one's


BAD_STOPS = [5, "", ["a", ""], ["a", "b", "c", "d", "e"], ["a", 3], {"a": 1}, ["x" * 300]]


def test_bad_stop_is_400_naming_stop(url):
    for stop in BAD_STOPS:
        for path, body in (("/v1/completions", {"prompt": PROMPT, "stop": stop}),
                           ("/v1/chat/completions", {"messages": CHAT, "stop": stop}),
                           ("/generate", {"text": PROMPT, "sampling_params": {"stop": stop}})):
            r = post(url, path, body)
            if path == "/generate" and stop == ["a", "b", "c", "d", "e"]:
                assert r.status_code == 200, r.text  # the native API allows more than OpenAI's 4
                continue
            assert r.status_code == 400, (path, stop, r.text)
            err = r.json()["error"]
            assert "stop" in err["message"] and err["param"].endswith("stop"), (path, stop, err)


def test_openai_sdk_stop_and_model_names(url, tok, reference):
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    assert [m.id for m in client.models.list().data] == list(NAMES)
    stop = find_stop(tok, reference["token_ids"], 2, False)
    for name in NAMES:  # every alias is served
        c = client.completions.create(model=name, prompt=PROMPT, max_tokens=N, temperature=1.0, seed=SEED,
                                      stop=[stop.text], extra_body={"ignore_eos": True})
        assert c.choices[0].text == stop.expected_text and c.choices[0].finish_reason == "stop"
        assert c.model == NAMES[0]
    chat = client.chat.completions.create(model=NAMES[1], messages=CHAT, max_tokens=8, temperature=0,
                                          stop=["\u2603"])
    assert chat.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT, max_tokens=2)


def test_unknown_model_is_vllms_404_and_no_model_is_served(url):
    r = post(url, "/v1/completions", {"model": "x", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 404
    assert r.json() == {"error": {"message": "The model `x` does not exist.", "type": "NotFoundError",
                                  "param": "model", "code": 404}}
    assert post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}).status_code == 200
    assert post(url, "/v1/completions", {"model": 3, "prompt": PROMPT, "max_tokens": 2}).status_code == 400
