"""Images through `relayrl serve` on the tiny random Idefics3: a real server subprocess, real HTTP, the openai SDK and
RemoteEngine as clients. What the server samples from an image is what a LocalEngine samples from it (same tokens,
same logprobs, and other ones for another image); a hostile image costs its own request a 400 naming the field and
nothing else; a multi-turn agent's every turn carries the prompt's images to the server; GRPO runs through a launched
server."""

import asyncio
import base64
import importlib
import io
import threading
from pathlib import Path

import httpx
import openai
import pytest
from conftest import TINY_RUN
from PIL import Image
from serve_for_tests import Server

from relayrl.agents.reflection import ReflectionAgent
from relayrl.cli import main
from relayrl.common.files import read_jsonl
from relayrl.engine.base import SamplingParams
from relayrl.engine.local import LocalEngine
from relayrl.engine.remote import RemoteEngine
from relayrl.engine.rollout import RolloutController
from relayrl.judge import Judge
from relayrl.models import load_tokenizer
from relayrl.models.vision import load_processor
from relayrl.sample import Sample

REPO = Path(__file__).parents[2]
ASK = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many red squares?"}]}]


def png(color, size=(48, 40)) -> bytes:
    buf = io.BytesIO()
    img = Image.new("RGB", size, (255, 255, 255))
    img.paste(Image.new("RGB", (12, 12), color), (8, 8))
    img.save(buf, format="PNG")
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def bomb() -> bytes:
    """A few KB of PNG that decodes to 64M pixels."""
    buf = io.BytesIO()
    Image.new("1", (8000, 8000)).save(buf, format="PNG")
    return buf.getvalue()


RED, BLUE, BOMB = png((255, 0, 0)), png((0, 0, 255)), bomb()
PARAMS = SamplingParams(max_new_tokens=6, temperature=1.0, ignore_eos=True, seed=11)


@pytest.fixture(scope="module")
def url(tiny_vlm_path, tmp_path_factory):
    server = Server(tiny_vlm_path, tmp_path_factory.mktemp("serve_vlm") / "serve.log")
    yield server.wait_ready()
    assert server.stop() == 0


@pytest.fixture(scope="module")
def prompt(tiny_vlm_path) -> list[int]:
    """The prompt as the data loader builds it: the chat template, expanded by the model's processor."""
    processor = load_processor(tiny_vlm_path)
    text = processor.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False)
    ids = processor(text=[text], images=[[Image.open(io.BytesIO(RED))]], add_special_tokens=False)["input_ids"][0]
    return [int(t) for t in ids]


@pytest.fixture(scope="module")
def local(tiny_vlm_path):
    engine = LocalEngine.from_pretrained(tiny_vlm_path, dtype="float32")
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def remote(url):
    engine = RemoteEngine(url)
    yield engine
    engine.close()


def same(a, b) -> None:
    assert a.output_ids == b.output_ids
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


def test_remote_engine_sends_images_and_matches_the_local_engine(local, remote, prompt):
    """RemoteEngine -> /generate with input_ids + image_data: the server keys and merges as a LocalEngine does."""
    for image in (RED, BLUE):
        served = asyncio.run(remote.agenerate(prompt, PARAMS, images=(image,)))
        same(served, local.submit(prompt, PARAMS, images=(image,)).result())
    red, blue = (asyncio.run(remote.agenerate(prompt, SamplingParams(max_new_tokens=1, seed=1), images=(img,)))
                 for img in (RED, BLUE))
    assert abs(red.logprobs[0] - blue.logprobs[0]) > 1e-4 or red.output_ids != blue.output_ids  # the image counts


def test_native_batch_takes_image_data_per_prompt(url, local, prompt):
    body = {"input_ids": [prompt, prompt], "image_data": [b64(RED), [f"data:image/png;base64,{b64(BLUE)}"]],
            "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True, "seed": 11},
            "return_logprob": True}
    r = httpx.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    for answer, image in zip(r.json(), (RED, BLUE)):
        out = local.submit(prompt, PARAMS, images=(image,)).result()
        assert answer["output_ids"] == out.output_ids
        assert [e[0] for e in answer["meta_info"]["output_token_logprobs"]] == pytest.approx(out.logprobs, abs=1e-4)


def test_openai_chat_with_an_image_part(url, local, prompt, tiny_vlm_path):
    """The chat prompt is the data loader's (template, then the processor's expansion); the answer is the engine's."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(RED)}"}},
        {"type": "text", "text": "How many red squares?"}]}]
    resp = client.chat.completions.create(model=tiny_vlm_path, messages=messages, max_tokens=6, temperature=1.0,
                                          seed=11, logprobs=True, extra_body={"return_token_ids": True,
                                                                              "ignore_eos": True})
    choice = resp.choices[0].model_dump()
    assert choice["prompt_token_ids"] == prompt
    out = local.submit(prompt, PARAMS, images=(RED,)).result()
    assert choice["token_ids"] == out.output_ids
    assert [t["logprob"] for t in choice["logprobs"]["content"]] == pytest.approx(out.logprobs, abs=1e-4)
    stream = client.chat.completions.create(model=tiny_vlm_path, messages=messages, max_tokens=6, temperature=1.0,
                                            seed=11, stream=True, extra_body={"return_token_ids": True,
                                                                              "ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == choice["message"]["content"]


@pytest.mark.parametrize(("value", "says"), [
    ("http://169.254.169.254/latest/meta-data", "not fetched"),
    ("/etc/passwd", "not fetched"),
    ("data:image/png;base64,@@@", "base64"),
    (b64(b"GIF89a this is no image"), "not a readable image"),
    (b64(RED[: len(RED) // 2]), "not a readable image"),
    (b64(BOMB), "pixels"),
], ids=["http-url", "path", "bad-base64", "not-an-image", "truncated", "bomb"])
def test_hostile_images_get_a_400_naming_the_field(url, prompt, value, says):
    native = httpx.post(url + "/generate", json={"input_ids": prompt, "image_data": [value]}, timeout=60)
    chat = httpx.post(url + "/v1/chat/completions", timeout=60, json={"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": value}}]}]})
    for r, field in ((native, "image_data[0]"), (chat, "messages[0].content[1].image_url.url")):
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == field and says in error["message"], error


def test_prompt_and_images_must_agree(url, prompt):
    cases = [({"input_ids": prompt}, "input_ids", "no images came with it"),
             ({"input_ids": prompt[:10], "image_data": b64(RED)}, "input_ids", "image tokens"),
             ({"input_ids": prompt, "image_data": [b64(RED)] * 9}, "image_data[8]", "more than 8 images"),
             ({"input_ids": prompt, "image_data": b64(RED), "return_logprob": True, "logprob_start_len": 0},
              "logprob_start_len", "images")]
    for body, field, says in cases:
        r = httpx.post(url + "/generate", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == field and says in r.text, r.text


def test_a_bomb_harms_no_other_request(url, local, prompt):
    """A decompression bomb and a good request at once: the bomb's request gets its 400, the other its answer."""
    results = {}

    def send(name, image):
        body = {"input_ids": prompt, "image_data": b64(image), "return_logprob": True,
                "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True, "seed": 11}}
        results[name] = httpx.post(url + "/generate", json=body, timeout=60)

    threads = [threading.Thread(target=send, args=a) for a in (("bomb", BOMB), ("good", RED))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["bomb"].status_code == 400 and results["bomb"].json()["error"]["param"] == "image_data"
    assert results["good"].status_code == 200, results["good"].text
    assert results["good"].json()["output_ids"] == local.submit(prompt, PARAMS, images=(RED,)).result().output_ids


def test_reflection_agent_sends_the_images_with_every_turn(remote, prompt, tiny_vlm_path):
    """Every turn's request holds the prompt's image tokens, so the server refuses one that comes without its images:
    three turns (no answer is right: a random model does not write the boxed answer) complete only when each carries
    them."""
    tok = load_tokenizer(tiny_vlm_path)
    judge = Judge(workers=1)
    try:
        agent = ReflectionAgent(RolloutController([remote]), tok, SamplingParams(max_new_tokens=4, temperature=1.0),
                                judge, max_turns=3, feedback="Wrong, try again.")
        samples = [Sample(prompt_ids=list(prompt), group_id="g", index=i, images=[RED], data={"answer": "987654321"})
                   for i in range(2)]

        async def go():
            return await asyncio.gather(*(agent.generate_sample(s) for s in samples))

        before = remote.stats["requests"]
        done = asyncio.run(go())
    finally:
        judge.close()
    assert remote.stats["requests"] - before == 3 * len(done)
    assert all(s.images == [RED] and s.prompt_ids == prompt for s in done)


@pytest.mark.slow  # a launched server and two training steps: about 15 s, more than this file's share of the suite
def test_grpo_through_a_launched_server(tiny_vlm_path, tmp_path, monkeypatch):
    """`relayrl train` on examples/vlm_squares.yaml with engine.kind=remote engine.launch=relayrl: the launched
    server samples from the images, and after the first step's weight reload its logprobs are still the trainer's
    (a server left on the old weights, or one that dropped the image, would differ by far more)."""
    monkeypatch.syspath_prepend(str(REPO))
    data = importlib.import_module("examples.vlm_squares").make_squares(tmp_path / "squares", n=4)
    keep = {k: v for k, v in TINY_RUN.items() if k not in ("run.steps", "run.name")}
    over = {**keep, "model.path": tiny_vlm_path, "data.train.source": data, "run.output_dir": str(tmp_path),
            "sampling.max_new_tokens": 4, "engine.kind": "remote", "engine.launch": "relayrl", "run.steps": 2}
    assert main(["train", "--config", str(REPO / "examples" / "vlm_squares.yaml"),
                 *[f"{k}={v}" for k, v in over.items()]]) == 0
    rows = [r for r in read_jsonl(tmp_path / "vlm_squares" / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["train/logprob_diff_engine_max"] < 1e-5 for r in rows), rows
