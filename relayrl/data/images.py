"""A row's images: the `image` / `images` column, read into image file bytes and checked when the dataset loads.

A row may carry one image (`image`) or a list (`images`), each as TRL and Hugging Face datasets write them: a path
(relative paths from the dataset file's folder), the file's bytes, a `datasets` Image value {"bytes", "path"}, or a
PIL image (a user function's rows). Every image is decoded once here under the limits of relayrl.models.images, so
a missing, corrupt, non-image or oversized file is an error naming the row and the column before any model loads.
The row then holds `images`: the files' bytes (PIL images re-encoded as PNG), in order.

Where the images go in the prompt: the `{"type": "image"}` content parts of its messages, in order (TRL's and HF's
multimodal messages). A text prompt, or messages without image parts, gets the images as image parts before the
text of its first user message, as TRL prepares such rows. The counts must agree.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from PIL import Image

from relayrl.common.errors import InputError
from relayrl.models.images import decode_image

IMAGES = "images"  # the row field holding the prompt's image files, once loaded
IMAGE_COLUMNS = ("images", "image")  # read in this order; map other names with `columns`


def read_images(where: str, row: dict[str, Any], base: Path | None) -> list[bytes] | None:
    """The row's images as checked file bytes, or None when it has no image column (or an empty one)."""
    for column in IMAGE_COLUMNS:
        value = row.get(column)
        if value is None or (isinstance(value, list) and not value):
            continue
        values = value if column == "images" and isinstance(value, list | tuple) else [value]
        return [_image_bytes(f"{where}: column {column!r}" + (f"[{i}]" if len(values) > 1 else ""), v, base)
                for i, v in enumerate(values)]
    return None


def _image_bytes(at: str, value: Any, base: Path | None) -> bytes:
    """One image value's file bytes, decoded once to check them."""
    if isinstance(value, Image.Image):
        buf = io.BytesIO()
        value.convert("RGB").save(buf, format="PNG")
        data = buf.getvalue()
    elif isinstance(value, dict) and ("bytes" in value or "path" in value):  # a `datasets` Image value
        data = value.get("bytes") or _read(at, value.get("path"), base)
    elif isinstance(value, bytes | bytearray):
        data = bytes(value)
    elif isinstance(value, str | Path):
        data = _read(at, value, base)
    else:
        raise InputError(f"{at} is a {type(value).__name__}; an image is a path, bytes, a datasets Image "
                         f"{{'bytes', 'path'}} or a PIL image")
    decode_image(data, at)
    return data


def _read(at: str, path: str | Path | None, base: Path | None) -> bytes:
    if not path:
        raise InputError(f"{at}: an image with neither bytes nor a path")
    p = Path(path).expanduser()
    if not p.is_absolute() and base is not None:
        p = base / p
    try:
        return p.read_bytes()
    except OSError as e:
        raise InputError(f"{at}: cannot read image file {str(p)!r}: {e.strerror or e}") from None


def with_image_parts(at: str, msgs: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """The messages with n image parts: as they are when their image parts number n; with n image parts put before
    the first user message's text when they have none (a text prompt with an image column); else an error."""
    have = sum(1 for m in msgs if isinstance(m["content"], list) for p in m["content"] if p.get("type") == "image")
    if have == n:
        return msgs
    if have:
        raise InputError(f"{at}: the messages hold {have} image parts and the row has {n} images")
    out = [dict(m) for m in msgs]
    first = next(i for i, m in enumerate(out) if m["role"] == "user")
    content = out[first]["content"]
    text = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
    out[first]["content"] = [{"type": "image"}] * n + text
    return out


def content_text(content: str | list[dict[str, Any]]) -> str:
    """A message's text: its string, or its text parts joined (image parts have none)."""
    if isinstance(content, str):
        return content
    return "".join(p.get("text") or "" for p in content if p.get("type") == "text")


def check_model_takes_images(rows: list[dict[str, Any]], key: str, takes_images: bool, model: str) -> None:
    """An image in the dataset of a text-only model is the user's error, reported before the model loads."""
    if takes_images:
        return
    for i, row in enumerate(rows):
        if row.get(IMAGES):
            raise InputError(f"{key}: row {i} has images, but model {model!r} is text-only (no vision config or "
                             f"processor); use a vision-language model or drop the image column")
