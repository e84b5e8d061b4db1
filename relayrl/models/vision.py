"""Vision-language policies: the model's image inputs, and the text embeddings with the vision features merged in.

The families relayrl runs are those whose images enter the text model only as features written over the prompt's
image placeholder tokens, at ordinary 1-D positions (Idefics3 / SmolVLM: relayrl.models.tiny_vlm says why). The text
model (`model.get_decoder()`) then runs on merged embeddings as on any prompt, so the engine's prefill and the
trainer's forward take `inputs_embeds` instead of `input_ids` and everything after (KV cache, decode, the LM head,
shared-prompt rows) is the text path.

Which positions hold an image: the first n image tokens of a row, n being the number of feature vectors its images
give; the processor wrote exactly those into the prompt (fewer is an error). The first n, not all: an image token
the model sampled, which a later turn's prompt holds after them, stays a text token, in the engine (which marks every
image token of the prompt it is given, relayrl.engine.vision) as in the trainer (which looks at the row's prompt).

Images travel as their file bytes (relayrl.models.images), and become pixel values here with the model's own image
processor: the engine and the trainer each do it, from the same bytes and so to the same pixels.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence

import torch
from transformers import AutoProcessor, PretrainedConfig

from relayrl.models.images import decode_image, image_digest

Images = tuple[bytes, ...]  # one prompt's images, in the order of their placeholders


def is_vision_config(config: PretrainedConfig | dict) -> bool:
    """Whether a model config (loaded, or config.json's mapping) is a vision-language model relayrl runs: a vision
    tower and an image token. The one test, for a loaded model and for a folder alike."""
    fields = config if isinstance(config, dict) else config.to_dict()
    return bool(fields.get("vision_config")) and fields.get("image_token_id") is not None


def is_vlm(model: torch.nn.Module) -> bool:
    return is_vision_config(model.config)


def load_processor(path: str | os.PathLike):
    """The processor (image processor + tokenizer + chat template) saved with a vision-language model."""
    return AutoProcessor.from_pretrained(path, local_files_only=True)


def images_key(images: Images) -> tuple[str, ...]:
    """What decides whether two prompts with the same tokens are the same prompt: their images' digests."""
    return tuple(image_digest(b) for b in images)


class PixelInputs:
    """A model's image processor over image bytes, with the pixels of recent image sets kept up to `keep_bytes` (a
    GRPO group's members share one image: processed once; an Idefics3 image in 13 tiles is about 20 MB of pixels)."""

    def __init__(self, processor, keep_bytes: int = 256 * 2**20):
        self.image_processor = processor.image_processor
        self._kept: OrderedDict[tuple[str, ...], dict[str, torch.Tensor]] = OrderedDict()
        self.keep_bytes, self._bytes = keep_bytes, 0

    def __call__(self, images: Images) -> dict[str, torch.Tensor]:
        """{pixel_values: [1, n, C, H, W], pixel_attention_mask: [1, n, H, W]} (as the processor returns them)."""
        key = images_key(images)
        if key in self._kept:
            self._kept.move_to_end(key)
            return self._kept[key]
        pil = [decode_image(b, f"image {i}") for i, b in enumerate(images)]
        out = dict(self.image_processor(images=[pil], return_tensors="pt"))
        self._kept[key] = out
        self._bytes += _nbytes(out)
        while self._bytes > self.keep_bytes and len(self._kept) > 1:
            self._bytes -= _nbytes(self._kept.popitem(last=False)[1])
        return out


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values() if isinstance(t, torch.Tensor))


def image_features(model: torch.nn.Module, pixels: dict[str, torch.Tensor]) -> torch.Tensor:
    """The connector's output for one prompt's images: [image tokens, text hidden], in placeholder order."""
    dev = model.get_input_embeddings().weight.device
    mask = pixels.get("pixel_attention_mask")
    out = model.get_image_features(pixel_values=pixels["pixel_values"].to(dev),
                                   pixel_attention_mask=None if mask is None else mask.to(dev))
    feats = out.pooler_output
    return torch.cat(list(feats)) if isinstance(feats, list | tuple) else feats.flatten(0, -2)


def image_positions(prompt: Sequence[int], token_id: int) -> list[int]:
    """Where a prompt's image tokens are (module docstring)."""
    return [i for i, t in enumerate(prompt) if t == token_id]


Placed = tuple[list[int], Images]  # a row's image positions (counted from position 0) and its images


def merged_embeddings(model: torch.nn.Module, input_ids: torch.Tensor, rows: Sequence[Placed | None],
                      pixels: PixelInputs, start: int = 0) -> torch.Tensor:
    """Text embeddings of `input_ids` [R, W] with each row's vision features written at its image positions.

    input_ids[r] holds row r's tokens from position `start` on (a prefill after a cached prefix), so only the image
    positions in [start, start + W) are written; rows[r] None: text only. Rows with the same images share one
    vision forward. A ValueError when a row has fewer image positions than its images give features."""
    embeds = model.get_input_embeddings()(input_ids)
    feats: dict[tuple[str, ...], torch.Tensor] = {}
    r_idx, c_idx, parts = [], [], []
    for r, row in enumerate(rows):
        if row is None or not row[1]:
            continue
        positions, images = row
        key = images_key(images)
        if key not in feats:
            feats[key] = image_features(model, pixels(images))
        f = feats[key]
        if len(positions) < f.shape[0]:
            raise ValueError(f"the prompt holds {len(positions)} image tokens and its {len(images)} images give "
                             f"{f.shape[0]} features: build the prompt with the model's processor")
        pos = torch.tensor(positions[: f.shape[0]])  # the first n (module docstring)
        keep = (pos >= start) & (pos < start + input_ids.shape[1])
        r_idx.append(torch.full((int(keep.sum()),), r))
        c_idx.append(pos[keep] - start)
        parts.append(f[keep.to(f.device)])
    if not parts:
        return embeds
    index = (torch.cat(r_idx).to(embeds.device), torch.cat(c_idx).to(embeds.device))
    return embeds.index_put(index, torch.cat(parts).to(embeds.dtype))
