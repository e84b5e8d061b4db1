"""Vision-language samples in the trainer: each row's images laid out beside its tokens, and the forward's
embeddings with the vision features merged in (relayrl.models.vision).

A row's images are its prompt's: a shared-prompt row (a GRPO group) holds one copy of the prompt, so the group shares
one vision forward, as it shared one prefill in the engine. Rows share a prompt only when their images are the same
too (`prompt_key`): two prompts with the same text and different images are different prompts.

What the trainer recomputes from: the image file bytes each sample carries (Sample.images), turned into pixels by the
model's own image processor, as the engine did. The bytes, not the processed pixels, stay in the sample: a pixel
tensor is [tiles, 3, H, W] fp32 (about 20 MB for an Idefics3 image in 13 tiles of 364 x 364), the file tens of KB,
and a rollout batch holds it once per sample until the trainer has taken it; processing again costs the trainer a few
ms of CPU per distinct image (PixelInputs keeps recent ones).
"""

from __future__ import annotations

import torch

from relayrl.models.vision import Images, PixelInputs, image_positions, is_vlm, load_processor, merged_embeddings
from relayrl.sample import Sample

RowImages = list[tuple[list[int], Images] | None]  # per row: (the row's prompt tokens, its images), None: text only


def prompt_key(sample: Sample) -> tuple:
    """What rows sharing a prompt must share: its tokens and its images."""
    return tuple(sample.prompt_ids), tuple(sample.images)


def row_images(samples: list[Sample], rows: list[list[int]]) -> RowImages | None:
    """Each row's prompt images (its first sample's: the row's samples share them, `prompt_key`); None when no
    sample has images."""
    if not any(samples[row[0]].images for row in rows):
        return None
    return [(samples[row[0]].prompt_ids, tuple(samples[row[0]].images)) if samples[row[0]].images else None
            for row in rows]


def pixel_inputs(model: torch.nn.Module) -> PixelInputs | None:
    """The image processor of a vision-language policy, from the folder it was loaded from (which relayrl's
    checkpoints write the processor into); None for a text model."""
    if not is_vlm(model):
        return None
    return PixelInputs(load_processor(model.name_or_path))


def with_images(model: torch.nn.Module, inputs: dict, images: RowImages, pixels: PixelInputs | None) -> dict:
    """The decoder's keyword arguments with `input_ids` replaced by the merged embeddings."""
    if pixels is None:
        raise ValueError(f"a batch with images for a {type(model).__name__}, which takes none")
    token_id = int(model.config.image_token_id)
    placed = [None if row is None else (image_positions(row[0], token_id), row[1]) for row in images]
    out = dict(inputs)
    out["inputs_embeds"] = merged_embeddings(model, out.pop("input_ids"), placed, pixels)
    return out
