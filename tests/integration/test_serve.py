"""`relayrl serve` end to end: a real server subprocess, real HTTP, the real `openai` client, no mocks.

Two servers start once per module (in parallel, to save time on small machines): the main one, shared
by most tests, which loads weights from under a --weights-root, and one with --api-key (and no weights root),
which the last test also shuts down with SIGTERM. Hostile clients: tests/integration/test_serve_hostile.py.
"""

import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from bounds import bound
from serve_for_tests import Server

from relayrl.engine.base import SamplingParams
from relayrl.engine.local import LocalEngine
from relayrl.models import eos_token_ids, load_model, load_tokenizer, save_pretrained_atomic

KEY = "sekrit-key"


@pytest.fixture(scope="module")
def weights_root(tmp_path_factory) -> Path:
    """The main server's --weights-root: /update_weights_from_disk loads only folders under it."""
    return tmp_path_factory.mktemp("weights")


@pytest.fixture(scope="module")
def servers(tiny_path, tmp_path_factory, weights_root):
    logs = tmp_path_factory.mktemp("serve")
    names = ("--served-model-name", tiny_path, "tiny")  # requests name the model "tiny"; responses the first name
    both = {"main": Server(tiny_path, logs / "main.log", "--weights-root", str(weights_root), *names),
            "key": Server(tiny_path, logs / "key.log", "--api-key", KEY, *names)}
    yield both
    codes = {name: s.stop() for name, s in both.items()}
    for s in both.values():  # reaped: no orphan left behind
        with pytest.raises(ProcessLookupError):
            os.kill(s.proc.pid, 0)
    assert codes == {"main": 0, "key": 0}, codes


@pytest.fixture(scope="module")
def url(servers):
    return servers["main"].wait_ready()


@pytest.fixture(scope="module")
def local(tiny_path):
    """The same model in this process: the reference the server must match token for token."""
    tok = load_tokenizer(tiny_path)
    model = load_model(tiny_path, dtype="float32")
    engine = LocalEngine(model, eos_token_ids=eos_token_ids(tok, tiny_path), max_batch_size=8)
    yield tok, model, engine
    engine.close()


def post(url: str, path: str, body: dict | None = None, **kw) -> httpx.Response:
    return httpx.post(url + path, json=body if body is not None else {}, timeout=60, **kw)


def generate(url: str, ids, **sampling) -> dict | list:
    r = post(url, "/generate", {"input_ids": ids, "sampling_params": sampling, "return_logprob": True})
    assert r.status_code == 200, r.text
    return r.json()


def version(url: str) -> int:
    return httpx.get(url + "/get_weight_version").json()["weight_version"]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, **kw)


def forward_logprobs(model, prompt: list[int], output: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(output)]


def until(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def in_thread(fn, *args, **kw) -> tuple[threading.Thread, dict]:
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(result=fn(*args, **kw)), daemon=True)
    t.start()
    return t, box


# ---- native API ------------------------------------------------------------------------------------------
def test_generate_is_token_and_logprob_exact(url, local):
    tok, model, engine = local
    prompt = tok("The answer is 42. How many apples")["input_ids"]
    v = version(url)
    got = generate(url, prompt, max_new_tokens=12, temperature=0, ignore_eos=True)
    ref = engine.generate([prompt], greedy(12, ignore_eos=True))[0]
    meta = got["meta_info"]
    assert got["output_ids"] == ref.output_ids
    assert [t for _, t, _ in meta["output_token_logprobs"]] == ref.output_ids
    served = [lp for lp, _, _ in meta["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(served, forward_logprobs(model, prompt, ref.output_ids))) < 1e-4
    assert got["text"] == tok.decode(ref.output_ids, skip_special_tokens=True)
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(prompt), 12)
    assert meta["weight_version"] == v and meta["output_token_versions"] == [v] * 12


def test_batch_stop_tokens_and_sampling_groups(url, local):
    tok, _, engine = local
    prompts = [tok("So Betty has")["input_ids"], tok("Question: How many are left?")["input_ids"]]
    got = post(url, "/generate", {"input_ids": prompts, "rid": ["a", "b"], "sampling_params": [
        {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}, {"max_new_tokens": 3, "temperature": 0}]}).json()
    assert [g["meta_info"]["id"] for g in got] == ["a", "b"]
    assert got[0]["output_ids"] == engine.generate([prompts[0]], greedy(6, ignore_eos=True))[0].output_ids
    assert got[1]["output_ids"] == engine.generate([prompts[1]], greedy(3))[0].output_ids
    assert "output_token_logprobs" not in got[0]["meta_info"]  # only with return_logprob
    # a stop token ends the output (included, as SGLang's output_ids do) with reason stop
    stop = got[0]["output_ids"][3]
    cut = got[0]["output_ids"].index(stop)
    stopped = generate(url, prompts[0], max_new_tokens=6, temperature=0, ignore_eos=True, stop_token_ids=[stop])
    assert stopped["output_ids"] == got[0]["output_ids"][: cut + 1]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    # n samples of one prompt: a list; a seeded group differs within, and repeats exactly
    group = generate(url, prompts[1], max_new_tokens=8, temperature=1.0, n=3, seed=7, ignore_eos=True)
    again = generate(url, prompts[1], max_new_tokens=8, temperature=1.0, n=3, seed=7, ignore_eos=True)
    assert len(group) == 3 and len({tuple(g["output_ids"]) for g in group}) == 3
    assert [g["output_ids"] for g in group] == [g["output_ids"] for g in again]
    text = post(url, "/generate", {"text": "The answer is", "sampling_params": {"max_new_tokens": 2}}).json()
    assert text["meta_info"]["prompt_tokens"] == len(tok("The answer is")["input_ids"])


def test_update_weights_from_disk(url, local, tiny_path, weights_root):
    tok, _, engine = local
    prompt = tok("Natalia sold 48 clips")["input_ids"]
    before = generate(url, prompt, max_new_tokens=10, temperature=0, ignore_eos=True)["output_ids"]
    perturbed = load_model(tiny_path, dtype="float32")
    with torch.no_grad():
        torch.manual_seed(0)
        for p in perturbed.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    folder = save_pretrained_atomic(perturbed, tok, weights_root / "perturbed")
    v = version(url)
    r = post(url, "/update_weights_from_disk", {"model_path": str(folder)})
    assert r.status_code == 200 and r.json()["success"] and r.json()["weight_version"] == v + 1, r.text
    after = generate(url, prompt, max_new_tokens=10, temperature=0, ignore_eos=True)
    engine.load_weights_from_disk(str(folder), v + 1)
    assert after["output_ids"] != before
    assert after["output_ids"] == engine.generate([prompt], greedy(10, ignore_eos=True))[0].output_ids
    assert after["meta_info"]["weight_version"] == v + 1 == version(url)
    assert after["meta_info"]["output_token_versions"] == [v + 1] * 10
    # a bad path is refused whole: success false, 400, nothing changed
    bad = post(url, "/update_weights_from_disk", {"model_path": str(weights_root / "missing")})
    assert bad.status_code == 400 and bad.json()["success"] is False and "missing" in bad.json()["message"]
    outside = post(url, "/update_weights_from_disk", {"model_path": tiny_path})  # not under --weights-root
    assert outside.status_code == 403 and "weights root" in outside.json()["error"]["message"]
    assert version(url) == v + 1
    # back to the original weights under an explicit version
    original = shutil.copytree(tiny_path, weights_root / "original")
    r = post(url, "/update_weights_from_disk", {"model_path": str(original), "weight_version": v + 5})
    assert r.json()["weight_version"] == v + 5 == version(url)
    engine.load_weights_from_disk(tiny_path, v + 5)
    assert generate(url, prompt, max_new_tokens=10, temperature=0, ignore_eos=True)["output_ids"] == before
    info = httpx.get(url + "/get_model_info").json()
    assert info["weight_version"] == v + 5 and info["max_seq_len"] == 1024 and info["model_path"] == tiny_path


def num_reqs(url: str) -> int:
    return httpx.get(url + "/get_load").json()[0]["num_reqs"]


def test_pause_continue_and_abort(url):
    prompt = [1, 20, 30, 40]
    assert post(url, "/pause_generation").json()["success"]
    try:
        t, box = in_thread(generate, url, prompt, max_new_tokens=4, temperature=0, ignore_eos=True)
        until(lambda: num_reqs(url) == 1)
        t.join(0.5)
        assert t.is_alive()  # held while paused
        assert httpx.get(url + "/health_generate").status_code == 503
        assert post(url, "/continue_generation").json()["success"]
        t.join(20)
        assert box["result"]["meta_info"]["finish_reason"]["type"] == "length"
        # abort one request by rid, then all of them
        post(url, "/pause_generation")
        runs = [in_thread(post, url, "/generate", {"input_ids": prompt, "rid": rid,
                                                   "sampling_params": {"max_new_tokens": 50}}) for rid in "xyz"]
        until(lambda: num_reqs(url) == 3)
        assert post(url, "/abort_request", {"rid": "x"}).json()["aborted"] == 1
        assert post(url, "/abort_request", {}).json()["aborted"] == 2
        for (t, box), rid in zip(runs, "xyz"):
            t.join(20)
            meta = box["result"].json()["meta_info"]
            assert meta["id"] == rid and meta["finish_reason"]["type"] == "abort"
    finally:
        post(url, "/continue_generation")
    assert httpx.get(url + "/health_generate").status_code == 200
    assert post(url, "/flush_cache").json()["success"]


# ---- OpenAI API ------------------------------------------------------------------------------------------
def client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def test_openai_chat(url, local, tiny_path):
    tok, _, engine = local
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is 2 + 2?"}]
    r = client(url).chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                            logprobs=True, extra_body={"return_token_ids": True})
    choice = r.choices[0]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = tok(rendered, add_special_tokens=False)["input_ids"]
    ref = engine.generate([prompt], greedy(8))[0]
    assert choice.model_extra["prompt_token_ids"] == prompt
    assert choice.model_extra["token_ids"] == ref.output_ids
    assert [c.logprob for c in choice.logprobs.content] == pytest.approx(ref.logprobs, abs=1e-5)
    assert choice.message.content == tok.decode(ref.output_ids, skip_special_tokens=True)
    assert choice.finish_reason == {"length": "length"}.get(ref.finish_reason, "stop")
    assert r.usage.prompt_tokens == len(prompt) and r.model == tiny_path
    several = client(url).chat.completions.create(model="tiny", messages=messages, max_tokens=4, n=2, seed=1)
    assert [c.index for c in several.choices] == [0, 1] and several.usage.completion_tokens <= 8
    tools = [{"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                               "parameters": {"type": "object", "properties": {"a": {}, "b": {}}}}}]
    r = client(url).chat.completions.create(model="tiny", messages=messages, max_tokens=4, tools=tools,
                                            extra_body={"return_token_ids": True})
    assert "add(a, b): Add two numbers" in tok.decode(r.choices[0].model_extra["prompt_token_ids"])
    with pytest.raises(openai.BadRequestError, match="stream_options"):  # streaming: tests/.../test_serve_stream.py
        client(url).chat.completions.create(model="tiny", messages=messages, stream=True, stream_options=[])


def test_openai_completions(url, local, tiny_path):
    tok, _, engine = local
    ids = tok("Let's think step by step.")["input_ids"]
    r = client(url).completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0, logprobs=1,
                                       extra_body={"return_token_ids": True})
    ref = engine.generate([ids], greedy(6))[0]
    choice = r.choices[0]
    assert choice.model_extra["prompt_token_ids"] == ids and choice.model_extra["token_ids"] == ref.output_ids
    assert choice.logprobs.token_logprobs == pytest.approx(ref.logprobs, abs=1e-5)
    assert choice.logprobs.tokens == [tok.decode([t]) for t in ref.output_ids]
    assert choice.text == tok.decode(ref.output_ids, skip_special_tokens=True)
    text = client(url).completions.create(model="tiny", prompt="The answer is", max_tokens=2,
                                          extra_body={"return_token_ids": True})
    assert text.choices[0].model_extra["prompt_token_ids"] == tok("The answer is")["input_ids"]
    assert text.choices[0].logprobs is None
    assert [m.id for m in client(url).models.list().data] == [tiny_path, "tiny"]


# ---- errors, auth, shutdown ------------------------------------------------------------------------------
BAD = [
    ("/generate", {}, "input_ids"),
    ("/generate", {"input_ids": []}, "input_ids"),
    ("/generate", {"input_ids": [1] * 1024}, "input_ids"),
    ("/generate", {"input_ids": [100000]}, "input_ids"),
    ("/generate", {"input_ids": [[1], "x"]}, "input_ids"),
    ("/generate", {"input_ids": [1], "sampling_params": {"temperature": -1}}, "temperature"),
    ("/generate", {"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
    ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 0}}, "max_new_tokens"),
    ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": "8"}}, "max_new_tokens"),
    ("/generate", {"input_ids": [1], "sampling_params": {"frobnicate": 1}}, "frobnicate"),
    ("/generate", {"input_ids": [1], "sampling_params": {"stop": [""]}}, "stop"),
    ("/generate", {"input_ids": [1], "sampling_params": {"repetition_penalty": 1.2}}, "repetition_penalty"),
    ("/generate", {"input_ids": [[1], [2]], "rid": ["a"]}, "rid"),
    ("/generate", {"input_ids": [1], "stream": True}, "stream"),
    ("/update_weights_from_disk", {}, "model_path"),
    ("/pause_generation", {"mode": "sideways"}, "mode"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop": 5}, "stop"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
]


def test_bad_requests_are_400_naming_the_field(url):
    for path, body, field in BAD:
        r = post(url, path, body)
        assert r.status_code == 400, (path, body, r.text)
        assert field in r.json()["error"]["message"], (path, body, r.text)
    r = httpx.post(url + "/generate", content=b"{not json", headers={"Content-Type": "application/json"}, timeout=10)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert httpx.get(url + "/health_generate").status_code == 200  # nothing reached (or broke) the batch


def test_api_key_then_graceful_shutdown(servers):
    server = servers["key"]
    key_url = server.wait_ready()
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(key_url + "/health").status_code == 200  # open: it is the liveness probe
    for path in ("/get_model_info", "/v1/models"):
        assert httpx.get(key_url + path).status_code == 401
        assert httpx.get(key_url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(key_url + path, headers=auth).status_code == 200
    assert post(key_url, "/generate", {"input_ids": [1]}).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        client(key_url).completions.create(model="tiny", prompt="hi", max_tokens=1)
    assert len(client(key_url, KEY).completions.create(model="tiny", prompt="hi", max_tokens=2).choices) == 1
    # no --weights-root: loading weights from disk is off, and says how to turn it on
    off = post(key_url, "/update_weights_from_disk", {"model_path": str(server.log.parent)}, headers=auth)
    assert off.status_code == 403 and "--weights-root" in off.json()["error"]["message"]
    # SIGTERM with a request in flight: it comes back aborted, and the process exits 0 promptly
    post(key_url, "/pause_generation", headers=auth)
    t, box = in_thread(post, key_url, "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 64}},
                       headers=auth)
    until(lambda: httpx.get(key_url + "/get_load", headers=auth).json()[0]["num_reqs"] == 1)
    start = time.monotonic()
    assert server.stop(timeout=10) == 0
    assert time.monotonic() - start < bound(10)
    t.join(10)
    assert box["result"].json()["meta_info"]["finish_reason"]["type"] == "abort"
