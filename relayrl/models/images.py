"""Images as a policy's input: decoded from their file bytes with limits, before anything else touches them.

Why limits: an image file is small on disk and large once decoded (a PNG of a few KB can hold 100k x 100k pixels:
tens of GB of RGB, a decompression bomb). The size in the header is read first and checked against MAX_PIXELS
before any pixel is decoded; PIL's own MAX_IMAGE_PIXELS guard (a warning, an error at twice it) is stricter here
because it is turned into an error at MAX_PIXELS. A truncated or non-image file fails to decode here, with the place
it came from named, not later inside a processor.

Only PIL: the data loader checks every image this way before a model loads.
"""

from __future__ import annotations

import hashlib
import io
import warnings

from PIL import Image, UnidentifiedImageError

from relayrl.common.errors import InputError

MAX_PIXELS = 4096 * 4096  # width x height of one image; a VLM's processor downsizes far below this anyway
MAX_BYTES = 32 * 2**20  # one image file


def image_digest(data: bytes) -> str:
    """A short content hash: the identity of an image for sharing a prompt's KV cache and vision features."""
    return hashlib.blake2b(data, digest_size=12).hexdigest()


def decode_image(data: bytes, where: str) -> Image.Image:
    """The RGB image in `data` (a PNG, JPEG, ... file), or an InputError naming `where` when it is too large, not
    an image, truncated or a decompression bomb."""
    if len(data) > MAX_BYTES:
        raise InputError(f"{where}: image file of {len(data)} bytes is over the limit of {MAX_BYTES}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            w, h = img.size  # from the header: nothing decoded yet
            if w * h > MAX_PIXELS:
                raise InputError(f"{where}: image of {w} x {h} pixels is over the limit of {MAX_PIXELS} pixels")
            img.load()
            return img.convert("RGB")
    except InputError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise InputError(f"{where}: image refused as a decompression bomb ({e})") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError) as e:
        raise InputError(f"{where}: not a readable image ({type(e).__name__}: {e})") from None
