"""`relayrl serve` against hostile clients: a real server subprocess (tiny random-init model, 127.0.0.1, an API
key, small limits, a --weights-root), real HTTP, no mocks.

Every hostile request is sent while good generations keep running; each must be refused with a 4xx that names
the offending field, in the OpenAI error shape, without internal details; the good ones must come back exactly
as an in-process engine generates them, and /health must answer afterwards. A request for as many samples as
the server allows must not hold up a small request sent after it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from bounds import bound
from serve_for_tests import ROOT, Server

from relayrl.common.net import is_loopback
from relayrl.engine.base import SamplingParams
from relayrl.engine.local import LocalEngine
from relayrl.models import eos_token_ids, load_model, load_tokenizer
from relayrl.serve.errors import BadRequest
from relayrl.serve.openai_api import make_openai_app

KEY = "hostile-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# slots 4 (so at most 2 per request at a time), at most 4 samples of 400 tokens, prompts of 256, 2000 in flight
FLAGS = ("--api-key", KEY, "--max-batch-size", "4", "--max-n", "4", "--max-tokens", "400", "--max-prompt-tokens",
         "256", "--max-tokens-in-flight", "2000", "--max-body-bytes", str(2**20))
GOOD = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}}


@pytest.fixture(scope="module")
def root(tmp_path_factory, tiny_path) -> Path:
    """The --weights-root, with traps in it: a symlink to a folder outside, and a folder whose safetensors
    file is a symlink to one outside."""
    root = tmp_path_factory.mktemp("weights-root")
    (root / "escape").symlink_to(tiny_path, target_is_directory=True)
    (root / "linked").mkdir()
    (root / "linked" / "model.safetensors").symlink_to(Path(tiny_path) / "model.safetensors")
    (root / "corrupt").mkdir()
    (root / "corrupt" / "model.safetensors").write_bytes(b"\xff" * 64)
    return root


@pytest.fixture(scope="module")
def server(tiny_path, root, tmp_path_factory):
    s = Server(tiny_path, tmp_path_factory.mktemp("hostile") / "server.log", *FLAGS, "--weights-root", str(root))
    s.wait_ready()
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def reference(tiny_path) -> list[int]:
    """What GOOD must generate: the same model, greedy, in this process."""
    engine = LocalEngine(load_model(tiny_path, dtype="float32"),
                         eos_token_ids=eos_token_ids(load_tokenizer(tiny_path), tiny_path))
    try:
        return engine.generate([GOOD["input_ids"]], SamplingParams(max_new_tokens=48, temperature=0,
                                                                   ignore_eos=True))[0].output_ids
    finally:
        engine.close()


def chat(**kw) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}


def sp(**kw) -> dict:
    return {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, **kw}}


# (path, JSON body, or raw bytes, the field the answer must name, the statuses allowed)
HOSTILE: list[tuple[str, object, str, tuple[int, ...]]] = [
    ("/generate", sp(temperature=float("nan")), "sampling_params.temperature", (400,)),
    ("/generate", sp(temperature=float("inf")), "sampling_params.temperature", (400,)),
    ("/generate", sp(temperature=1e308), "sampling_params.temperature", (400,)),
    ("/generate", sp(temperature=-1), "sampling_params.temperature", (400,)),
    ("/generate", sp(temperature="hot"), "sampling_params.temperature", (400,)),
    ("/generate", sp(top_p=0), "sampling_params.top_p", (400,)),
    ("/generate", sp(top_p=float("nan")), "sampling_params.top_p", (400,)),
    ("/generate", sp(top_k=-2), "sampling_params.top_k", (400,)),
    ("/generate", sp(top_k=10**30), "sampling_params.top_k", (400,)),
    ("/generate", sp(max_new_tokens=-5), "sampling_params.max_new_tokens", (400,)),
    ("/generate", sp(max_new_tokens=10**12), "sampling_params.max_new_tokens", (400,)),
    ("/generate", sp(max_new_tokens=1e308), "sampling_params.max_new_tokens", (400,)),
    ("/generate", sp(max_new_tokens=8.5), "sampling_params.max_new_tokens", (400,)),
    ("/generate", sp(max_new_tokens=True), "sampling_params.max_new_tokens", (400,)),
    ("/generate", sp(n=10**9), "sampling_params.n", (400,)),
    ("/generate", sp(n=0), "sampling_params.n", (400,)),
    ("/generate", sp(n=1.5), "sampling_params.n", (400,)),
    ("/generate", sp(seed=2**64), "sampling_params.seed", (400,)),
    ("/generate", sp(seed=float("-inf")), "sampling_params.seed", (400,)),
    ("/generate", sp(stop_token_ids=[10**30]), "sampling_params.stop_token_ids", (400,)),
    ("/generate", sp(ignore_eos="yes"), "sampling_params.ignore_eos", (400,)),
    ("/generate", {"input_ids": [512]}, "input_ids", (400,)),
    ("/generate", {"input_ids": [-1]}, "input_ids", (400,)),
    ("/generate", {"input_ids": [2**70]}, "input_ids", (400,)),
    ("/generate", {"input_ids": [1.5]}, "input_ids", (400,)),
    ("/generate", {"input_ids": [True]}, "input_ids", (400,)),
    ("/generate", {"input_ids": [1] * 257}, "input_ids", (400, 413)),
    ("/generate", {"input_ids": [[1]] * 5}, "input_ids", (400,)),
    ("/generate", {"text": "a b " * 300}, "text", (400, 413)),  # 1200 characters, 600 tokens
    ("/generate", {"text": "a" * 100_000}, "text", (400, 413)),
    ("/generate", {"input_ids": [1] * 256, "sampling_params": {"n": 4, "max_new_tokens": 400}},
     "sampling_params.max_new_tokens", (400, 429)),  # 4 x 656 tokens: more than the whole budget
    ("/generate", {"input_ids": [1], "rid": 123}, "rid", (400,)),
    ("/generate", {"input_ids": [1], "rid": "r" * 1000}, "rid", (400,)),
    ("/generate", {"input_ids": [1], "return_logprob": "yes"}, "return_logprob", (400,)),
    ("/generate", b'{"text": "\xff\xfe"}', "body", (400,)),  # invalid UTF-8
    ("/generate", b'{"text": "\\ud800"}', "text", (400,)),  # a lone surrogate
    ("/generate", b'{"input_ids": [1], "\\udfff": 1}', "body", (400,)),
    ("/generate", b"[" * 50_000 + b"]" * 50_000, "body", (400,)),
    ("/generate", b'{"input_ids": [' + b"9" * 5000 + b"]}", "body", (400,)),
    ("/generate", b"x" * (2**20 + 1), "body", (413,)),
    ("/abort_request", {"rid": 5}, "rid", (400,)),
    ("/pause_generation", {"mode": "sideways"}, "mode", (400,)),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1e308, "rank_offset": 1,
                                    "world_size": 2, "backend": "gloo"}, "master_port", (400,)),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1,
                                    "world_size": 2, "backend": "gloo", "timeout": float("nan")}, "timeout", (400,)),
    ("/update_weights_from_disk", {"model_path": "/etc"}, "model_path", (403,)),
    ("/update_weights_from_disk", {"model_path": "../../../../../../etc"}, "model_path", (403,)),
    ("/update_weights_from_disk", {"model_path": "{root}/../.."}, "model_path", (403,)),
    ("/update_weights_from_disk", {"model_path": "{root}/escape"}, "model_path", (403,)),  # symlinked folder
    ("/update_weights_from_disk", {"model_path": "{root}/linked"}, "model_path", (403,)),  # symlinked file
    ("/update_weights_from_disk", {"model_path": "{root}/corrupt"}, "model_path", (400,)),
    ("/update_weights_from_disk", {"model_path": "{root}\x00/x"}, "model_path", (400,)),
    ("/update_weights_from_disk", {"model_path": "{root}/corrupt", "weight_version": 1e308}, "weight_version", (400,)),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**9}, "max_tokens", (400,)),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 401}, "max_tokens", (400,)),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens", (400,)),
    ("/v1/completions", {"prompt": "hi", "n": 10**6}, "n", (400,)),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n", (400,)),
    ("/v1/completions", {"prompt": "hi", "temperature": float("nan")}, "temperature", (400,)),
    ("/v1/completions", {"prompt": [600]}, "prompt[0]", (400,)),
    ("/v1/completions", {"prompt": ["hi"] * 5}, "prompt", (400,)),
    ("/v1/completions", {"prompt": "hi", "logprobs": 10**9}, "logprobs", (400,)),
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, "best_of", (400,)),
    ("/v1/chat/completions", chat(messages="hi"), "messages", (400,)),
    ("/v1/chat/completions", chat(messages=[{"content": "hi"}]), "messages[0]", (400,)),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
     "messages[0].content", (400,)),
    ("/v1/chat/completions", chat(tools=[{"function": {}}]), "tools[0]", (400,)),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "a b " * 1500}]), "messages", (400, 413)),
    ("/v1/chat/completions", chat(max_tokens=1e308), "max_tokens", (400,)),
    ("/v1/chat/completions", chat(seed=float("nan")), "seed", (400,)),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content", (400,)),
]
UNAUTHORIZED = [("POST", "/generate", None), ("POST", "/generate", "Bearer wrong"),
                ("POST", "/update_weights_from_disk", None), ("POST", "/v1/chat/completions", "Bearer " + KEY + "x"),
                ("GET", "/get_model_info", None), ("GET", "/v1/models", "Basic " + KEY)]


def send(url: str, path: str, body: object, root: Path) -> httpx.Response:
    """POST `body` as it is (bytes) or as JSON with NaN and Infinity written out, as Python's json writes them
    (httpx refuses to)."""
    if not isinstance(body, bytes):
        if path == "/update_weights_from_disk":
            body = {k: v.replace("{root}", str(root)) if isinstance(v, str) else v for k, v in body.items()}
        body = json.dumps(body).encode()
    return httpx.post(url + path, content=body, headers={**AUTH, "Content-Type": "application/json"}, timeout=60)


def check_refusal(r: httpx.Response, field: str, statuses: tuple[int, ...], what: str) -> None:
    """A 4xx naming `field`, with no internal detail; OpenAI's shape (SGLang's success/message on the weight
    routes, as SGLang answers them)."""
    assert r.status_code in statuses, (what, r.status_code, r.text[:500])
    body = r.json()
    if "error" in body:
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"}, (what, body)
        message = err["message"]
        assert err["param"] == field or (err["param"] or "").startswith(field), (what, body)
    else:
        message = body["message"]
        assert body["success"] is False, (what, body)
    assert field in message, (what, message)
    assert "Traceback" not in r.text and "Error:" not in message, (what, message)


class GoodTraffic:
    """GOOD requests one after another in a thread until stopped: a good generation is always in flight."""

    def __init__(self, url: str):
        self.url, self.outputs, self.errors = url, [], []
        self.stop, self.thread = threading.Event(), threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            r = httpx.post(self.url + "/generate", json=GOOD, headers=AUTH, timeout=60)
            (self.outputs if r.status_code == 200 else self.errors).append(r.json())


def test_hostile_requests_are_refused_while_good_ones_run(server, root, reference):
    traffic = GoodTraffic(server.url)
    traffic.thread.start()
    try:
        for i, (path, body, field, statuses) in enumerate(HOSTILE):
            check_refusal(send(server.url, path, body, root), field, statuses, f"#{i} {path} {str(body)[:80]}")
        for method, path, auth in UNAUTHORIZED:
            r = httpx.request(method, server.url + path, json={}, headers={"Authorization": auth} if auth else {})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
        for path in ("/docs", "/redoc", "/openapi.json"):  # with a key set they are off, for everyone
            assert httpx.get(server.url + path).status_code == 404
            assert httpx.get(server.url + path, headers=AUTH).status_code == 404
        chunked = httpx.post(server.url + "/generate", content=(b"x" * 2**16 for _ in range(20)),
                             headers={**AUTH, "Content-Type": "application/json"})
        assert chunked.status_code == 413  # no Content-Length: cut off while reading
    finally:
        traffic.stop.set()
        traffic.thread.join(60)
    assert not traffic.errors and traffic.outputs, traffic.errors[:3]
    assert all(o["output_ids"] == reference for o in traffic.outputs)  # exactly as an undisturbed engine
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/health_generate", headers=AUTH).status_code == 200
    log = server.log.read_text()
    assert "Traceback" not in log and "internal error" not in log  # nothing failed inside the server


def test_largest_request_does_not_starve_a_small_one(server):
    """n = --max-n samples of --max-tokens tokens each run at most half the slots at a time: a small request
    sent after it starts at once and finishes long before it."""
    big_body = {"input_ids": [1, 2, 3], "sampling_params": {"n": 4, "max_new_tokens": 400, "ignore_eos": True}}
    big: dict = {}

    def run_big() -> None:
        big["r"] = httpx.post(server.url + "/generate", json=big_body, headers=AUTH, timeout=300)
        big["done"] = time.monotonic()

    thread = threading.Thread(target=run_big, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while httpx.get(server.url + "/get_load", headers=AUTH).json()[0]["num_reqs"] < 4:
        assert time.monotonic() < deadline and thread.is_alive(), "the large request never got going"
        time.sleep(0.01)
    start = time.monotonic()
    huge = httpx.post(server.url + "/generate", json=sp(n=10**9), headers=AUTH, timeout=30)
    assert huge.status_code == 400 and time.monotonic() - start < 5  # refused at once, not queued
    small = httpx.post(server.url + "/generate", json={"input_ids": [9, 9], "sampling_params": {
        "max_new_tokens": 4, "ignore_eos": True}}, headers=AUTH, timeout=60)
    small_done = time.monotonic()
    assert small.status_code == 200 and len(small.json()["output_ids"]) == 4
    thread.join(300)
    assert big["r"].status_code == 200 and [len(o["output_ids"]) for o in big["r"].json()] == [400] * 4
    assert small_done < big["done"] and small_done - start < 10, (small_done - start, big["done"] - start)


def test_a_client_that_hangs_up_frees_its_samples(server):
    """On both APIs: the samples of requests whose clients went away leave the queue and the engine soon after
    (the server checks for a hang-up every second), well before they would have finished generating for nobody.
    "Well before" is measured on this machine: the same requests are first run to the end."""
    bodies = {"/generate": {"input_ids": [4, 5], "sampling_params": {"n": 4, "max_new_tokens": 400,
                                                                     "ignore_eos": True}},
              "/v1/completions": {"prompt": [4, 5], "n": 4, "max_tokens": 400, "ignore_eos": True}}

    def post(path: str, body: dict, read: float | None, outcome: list) -> None:
        try:
            httpx.post(server.url + path, json=body, headers=AUTH, timeout=httpx.Timeout(120, read=read))
            outcome.append("answered")
        except httpx.ReadTimeout:
            outcome.append("hung up")

    def clients(path: str, body: dict, read: float | None) -> tuple[list[str], float]:
        """Eight clients at once (32 samples through 4 slots: several rounds of decoding); seconds until the
        server has nothing left to run."""
        outcome: list[str] = []
        start = time.monotonic()
        threads = [threading.Thread(target=post, args=(path, body, read, outcome)) for _ in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        while httpx.get(server.url + "/get_load", headers=AUTH).json()[0]["num_reqs"]:
            assert time.monotonic() - start < bound(120), f"{path}: samples still running"
            time.sleep(0.05)
        return outcome, time.monotonic() - start

    for path, body in bodies.items():
        outcome, full = clients(path, body, read=None)
        assert outcome == ["answered"] * 8, outcome
        outcome, cleared = clients(path, body, read=0.5)
        assert outcome == ["hung up"] * 8, outcome
        assert cleared < max(0.6 * full, 1.6), f"{path}: freed after {cleared:.2f}s; the whole work takes {full:.2f}s"


def test_internal_errors_name_only_a_request_id(caplog):
    """A failure inside the server (here a backend that raises) answers 500 with a request id; the exception's
    text and traceback go to the log under that id, never to the client."""
    class Broken:
        model_name = "broken"

        async def chat(self, body: dict, session: str | None) -> dict:
            raise RuntimeError("secret detail: /srv/models/private")

        async def complete(self, body: dict, session: str | None) -> dict:
            raise BadRequest("prompt", "is not what this backend wants")

    async def go() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        transport = httpx.ASGITransport(app=make_openai_app(Broken()))
        async with httpx.AsyncClient(transport=transport, base_url="http://relayrl") as c:
            return (await c.post("/v1/chat/completions", json={"messages": []}),
                    await c.post("/v1/completions", json={"prompt": "x"}), await c.get("/v2/nothing"))

    with caplog.at_level(logging.ERROR, logger="relayrl.serve"):
        crashed, refused, missing = asyncio.run(go())
    err = crashed.json()["error"]
    assert crashed.status_code == 500 and err["type"] == "server_error" and "internal error" in err["message"]
    assert "secret" not in crashed.text and "RuntimeError" not in crashed.text
    rid = re.search(r"request id (\w+)", err["message"]).group(1)
    assert [r for r in caplog.records if rid in r.getMessage() and "secret detail" in str(r.exc_info[1])]
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt"
    assert missing.status_code == 404 and set(missing.json()["error"]) == {"message", "type", "param", "code"}


def test_non_loopback_without_key_refuses_to_start(tiny_path, tmp_path):
    """The check runs before the model loads; the message says what to do, with no traceback."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for extra in (["--host", "0.0.0.0"], ["--host", "::"], ["--weights-root", str(tmp_path / "absent")]):
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "relayrl.cli", "serve", "--model", tiny_path, "--port", "0",
                               *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, (extra, done.stdout, done.stderr)
        assert "Traceback" not in done.stderr and "ready on" not in done.stdout, done.stderr
        assert ("--api-key" in done.stderr and "--insecure" in done.stderr) or "--weights-root" in done.stderr
        assert time.monotonic() - start < bound(60)


def test_loopback_detection():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("[::1]") and is_loopback("localhost")
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.1.2.3", "192.168.0.1", "no-such-host.invalid"))
