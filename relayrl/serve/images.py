"""Images in requests to `relayrl serve`: read, checked and expanded before any of it reaches the engine.

What a client may send: an image as its file's bytes in base64, bare (SGLang's /generate `image_data`) or as a data
URL (`data:image/png;base64,...`, OpenAI's `image_url` content parts). An http(s) URL or a file path is refused with
a 400 naming the field: fetching it would let any client make the server reach addresses only it can (SSRF), or
read its files; the client fetches the image and sends its bytes.

Every image is checked here, before the engine sees it, with the data loader's checks (relayrl.models.images: size
from the header, decompression bombs, truncated or non-image files) under the serve limits below, on a worker
thread: a hostile image costs its own request a 400 and never reaches the engine, whose prefill batches other
requests' prompts with it. A prompt's image tokens are checked against what its images need, so the engine's merge
(relayrl.models.vision) cannot fail on a request inside a shared prefill.

Token-in/token-out: /generate takes the prompt as the model's processor expanded it (what the data loader builds
and the trainer packs), unchanged; chat renders the template with one image placeholder per image part and
expands each into that image's tokens with the processor, as the data loader does.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import re
import threading
from collections.abc import Sequence
from typing import Any

from PIL import Image

from relayrl.common.errors import InputError
from relayrl.models.images import MAX_PIXELS, decode_image
from relayrl.models.vision import load_processor
from relayrl.serve.errors import BadRequest

MAX_IMAGE_BYTES = 8 * 2**20  # one image file, decoded from its base64 (the body limit bounds the request's total)
MAX_IMAGES = 8  # images in one request, over all its prompts and messages
MAX_IMAGE_PIXELS = MAX_PIXELS  # width x height, read from the header before any pixel is decoded (the loader's)
_OBJECT_REPR = re.compile(r" ?<[\w.]+ object at 0x[0-9a-fA-F]+>")
_DATA_URL = re.compile(r"^data:image/[A-Za-z0-9.+-]+;base64,", re.IGNORECASE)


def image_bytes(value: Any, field: str) -> bytes:
    """One image's file bytes from base64 or a base64 data URL; a 400 naming `field` for anything else (module
    docstring: no URLs, no paths) or for a file over MAX_IMAGE_BYTES, judged before decoding the base64."""
    if not isinstance(value, str) or not value:
        raise BadRequest(field, "must be an image as base64 or a data:image/...;base64, URL")
    if value.lower().startswith(("http://", "https://", "file:", "/")):
        raise BadRequest(field, "image URLs and paths are not fetched by this server (SSRF); send the image's bytes "
                         "as a data:image/...;base64, URL", "unsupported_value")
    m = _DATA_URL.match(value)
    if value.startswith("data:") and m is None:
        raise BadRequest(field, "must be a data:image/<type>;base64, URL")
    payload = value[m.end():] if m else value
    if len(payload) * 3 // 4 > MAX_IMAGE_BYTES:
        raise BadRequest(field, f"image of about {len(payload) * 3 // 4} bytes is over this server's limit of "
                         f"{MAX_IMAGE_BYTES} bytes per image", "image_too_large")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(field, "is not valid base64") from None


def check_image(data: bytes, field: str) -> Image.Image:
    """The decoded image, or a 400 naming `field`: too many pixels (from the header, before decoding), not an
    image, truncated, a decompression bomb (relayrl.models.images)."""
    try:
        return decode_image(data, field)
    except InputError as e:
        message = _OBJECT_REPR.sub("", str(e).removeprefix(f"{field}: "))  # no addresses go to clients
        raise BadRequest(field, message, "invalid_image") from None


class ServeImages:
    """The served model's image side: what its processor makes of an image (its tokens), for checks and chat."""

    def __init__(self, processor: Any, image_token_id: int):
        self.processor, self.token_id = processor, image_token_id
        self.placeholder = processor.tokenizer.convert_ids_to_tokens(image_token_id)
        self._lock = threading.Lock()  # the processor's tokenizer is called from worker threads, one at a time

    @classmethod
    def for_engine(cls, engine: Any, processor_path: str) -> ServeImages | None:
        """The image side of a served vision-language model (None for a text model: images are refused)."""
        if engine.vision is None:
            return None
        return cls(load_processor(processor_path), engine.vision.token_id)

    def expansion(self, image: Image.Image) -> list[int]:
        """The tokens the processor writes for one image placeholder (every one is a special token, so they are the
        same in the placeholder's context: the data loader's prompt)."""
        with self._lock:
            ids = self.processor(text=[self.placeholder], images=[[image]], add_special_tokens=False)["input_ids"][0]
        return [int(t) for t in ids]

    def needed(self, image: Image.Image) -> int:
        """How many image tokens the image's features fill (relayrl.models.vision.merged_embeddings)."""
        return sum(1 for t in self.expansion(image) if t == self.token_id)

    def check_prompt(self, prompt: list[int], images: Sequence[Image.Image], field: str) -> None:
        """A prompt from a client (/generate input_ids) holds at least the image tokens its images fill."""
        have = sum(1 for t in prompt if t == self.token_id)
        if images and have < (need := sum(self.needed(img) for img in images)):
            raise BadRequest(field, f"holds {have} image tokens ({self.token_id}); its {len(images)} images need "
                             f"{need}: expand the prompt with the model's processor")
        if not images and have:
            raise BadRequest(field, f"holds image tokens ({self.token_id}) but no images came with it")

    def expand(self, prompt: list[int], images: Sequence[Image.Image], field: str) -> list[int]:
        """A rendered chat prompt with each image placeholder replaced by its image's tokens, in order."""
        where = [i for i, t in enumerate(prompt) if t == self.token_id]
        if len(where) != len(images):
            raise BadRequest(field, f"the rendered prompt holds {len(where)} image placeholders for {len(images)} "
                             "images (is the placeholder typed in the text?)")
        out, last = [], 0
        for i, img in zip(where, images):
            out += prompt[last:i] + self.expansion(img)
            last = i + 1
        return out + prompt[last:]


async def read_images(values: Sequence[tuple[Any, str]], served: ServeImages | None) -> list[tuple[bytes, Image.Image]]:
    """Each (value, field) as (file bytes, decoded image), decoded on a worker thread; a 400 naming the field of
    the first bad one, or when the served model takes no images."""
    if not values:
        return []
    if served is None:
        raise BadRequest(values[0][1], "this server's model takes no images (a text-only model)", "unsupported_value")
    if len(values) > MAX_IMAGES:
        raise BadRequest(values[MAX_IMAGES][1], f"more than {MAX_IMAGES} images in one request", "too_many_images")
    raw = [(image_bytes(v, field), field) for v, field in values]
    decoded = await asyncio.to_thread(lambda: [check_image(data, field) for data, field in raw])
    return [(data, img) for (data, _), img in zip(raw, decoded)]
