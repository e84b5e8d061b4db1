"""Image inputs of `relayrl serve` checked before anything reaches an engine (relayrl.serve.images): the refusals
that need no model -- a text-only model, oversized base64, image parts where images are not taken -- and a vLLM
RemoteEngine refusing images before any HTTP. The served paths on the tiny VLM: tests/integration/test_serve_vlm.py."""

import asyncio
import base64
import io

import pytest
from PIL import Image

from relayrl.engine.base import SamplingParams
from relayrl.engine.remote import RemoteEngine
from relayrl.serve import openai_params
from relayrl.serve.errors import BadRequest
from relayrl.serve.images import MAX_IMAGE_BYTES, image_bytes, read_images
from relayrl.serve.limits import ServerLimits
from relayrl.serve.parsing import parse_generate

LIMITS = ServerLimits.for_engine(256, 512, 8)


def png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (255, 0, 0)).save(buf, format="PNG")
    return buf.getvalue()


async def no_tokenizer(texts):
    raise AssertionError("not called")


def test_a_text_only_model_refuses_images_naming_the_field():
    body = {"input_ids": [[1, 2], [3, 4]], "image_data": [None, [base64.b64encode(png()).decode()]]}
    with pytest.raises(BadRequest) as e:
        asyncio.run(parse_generate(body, LIMITS, no_tokenizer, None))
    assert e.value.field == "image_data[1][0]" and "takes no images" in str(e.value)
    with pytest.raises(BadRequest, match="takes no images"):
        asyncio.run(read_images([("data:image/png;base64,", "messages[0].content[0].image_url.url")], None))
    jobs, _ = asyncio.run(parse_generate({"input_ids": [1, 2]}, LIMITS, no_tokenizer, None))  # text still served
    assert jobs[0].images == ()


def test_image_values_are_bytes_only():
    data = png()
    assert image_bytes(base64.b64encode(data).decode(), "f") == data
    assert image_bytes("data:image/png;base64," + base64.b64encode(data).decode(), "f") == data
    for value, says in [("https://example.com/a.png", "not fetched"), ("file:///etc/passwd", "not fetched"),
                        ("data:text/plain;base64,aGk=", "data:image"), (42, "base64"), ("", "base64"),
                        ("A" * (MAX_IMAGE_BYTES * 4 // 3 + 8), "over this server's limit")]:
        with pytest.raises(BadRequest) as e:
            image_bytes(value, "image_data[2]")
        assert e.value.field == "image_data[2]" and says in str(e.value)


def test_image_parts_only_where_images_are_taken():
    msgs = [{"role": "user", "content": [{"type": "text", "text": "what is it?"},
                                         {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]
    with pytest.raises(BadRequest, match="only text"):  # a text-only served model; the episode proxy's backend
        openai_params.messages(msgs, LIMITS)
    kept, found = openai_params.take_images(openai_params.messages(msgs, LIMITS, images=True))
    assert kept[0]["content"] == [{"type": "text", "text": "what is it?"}, {"type": "image"}]
    assert found == [("data:image/png;base64,AA==", "messages[0].content[1].image_url.url")]


def test_vllm_remote_engine_refuses_images_before_any_request():
    engine = RemoteEngine("http://127.0.0.1:9", backend="vllm")
    try:
        with pytest.raises(ValueError, match="vLLM server token-in/token-out"):
            asyncio.run(engine.agenerate([1, 2], SamplingParams(max_new_tokens=2), images=(png(),)))
        assert engine.stats["requests"] == 0
    finally:
        engine.close()
