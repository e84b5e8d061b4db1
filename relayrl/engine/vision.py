"""Images in LocalEngine: prompts whose image tokens stand for their images, and the prefill's merged embeddings.

Why keyed tokens: the engine shares work between prompts by comparing their token ids (a GRPO group's one prefill,
a running twin's KV, the shared start of prompts admitted together, a trajectory's parked prefix). Two prompts with
the same text and different images have the same token ids, and must share nothing past their first image token.
So on entry a prompt's image tokens are replaced by one negative id, a hash of its images (`keyed`): equal keyed
prompts have equal tokens and equal images, every comparison the engine makes stays right as it is, and prefixes are
shared up to the first image token where the images differ. The images are kept by that id (`EngineVision._sets`).

A prefill forward whose rows hold keyed tokens runs on embeddings: the image token's embedding, with each image
position's vision feature written over it (relayrl.models.vision); decode steps feed sampled tokens only, plain text.
The features are computed in each prefill from the images' pixels (kept per image set by PixelInputs), under the
weights of that moment: a prompt rebuilt after a weight update gets the new vision tower's features.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

from relayrl.models.vision import Images, PixelInputs, images_key, is_vlm, load_processor, merged_embeddings


class EngineVision:
    """A vision-language model's image side in LocalEngine: keys prompts, keeps their images, embeds prefills."""

    def __init__(self, model: torch.nn.Module, pixels: PixelInputs):
        self.model, self.pixels = model, pixels
        self.token_id = int(model.config.image_token_id)
        self._sets: dict[int, Images] = {}
        self._prune_at = 256  # image sets kept before the next prune (`prune`): twice those alive after it

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> EngineVision | None:
        """The engine's image side when `model` is a vision-language model (its processor read from the folder the
        model was loaded from, where relayrl's saved models keep it too); None for a text model."""
        if not is_vlm(model):
            return None
        return cls(model, PixelInputs(load_processor(model.name_or_path)))

    def keyed(self, input_ids: list[int], images: Images) -> list[int]:
        """`input_ids` with its image tokens replaced by its images' key (module docstring)."""
        n = sum(1 for t in input_ids if t == self.token_id)
        if not n:
            raise ValueError(f"{len(images)} images came with a prompt that has no image token "
                             f"({self.token_id}): build the prompt with the model's processor")
        digest = hashlib.blake2b("/".join(images_key(images)).encode(), digest_size=7).digest()
        key = -1 - int.from_bytes(digest, "big")
        self._sets[key] = tuple(images)
        return [key if t == self.token_id else t for t in input_ids]

    def prune(self, alive: Iterable[list[int]]) -> None:
        """Forget the image sets no prompt in `alive` (waiting, running, parked, shared) refers to, once there are
        more than the last prune left alive twice over. The engine calls it under the lock it keys new prompts
        under (`keyed_prompt`), so no prompt's images go between its keying and its joining the queue."""
        if len(self._sets) <= self._prune_at:
            return
        used = {t for tokens in alive for t in tokens if t < 0}
        self._sets = {k: v for k, v in self._sets.items() if k in used}
        self._prune_at = max(256, 2 * len(self._sets))

    def inputs(self, ids: torch.Tensor, rows: list[list[int]], start: int) -> dict[str, torch.Tensor]:
        """The decoder's input for a prefill of rows[r][start:] laid out in `ids` [R, W]: `input_ids` when no image
        position is in this forward, else `inputs_embeds` with the vision features at the image positions."""
        if not bool((ids < 0).any()):  # no image position in this forward (none, or all in the cached prefix)
            return {"input_ids": ids}
        placed = []
        for row in rows:
            where = [i for i, t in enumerate(row) if t < 0]
            if where and row[where[0]] not in self._sets:
                raise RuntimeError("a prompt's images were forgotten while it was in the engine")
            placed.append((where, self._sets[row[where[0]]]) if where else None)
        plain = ids.masked_fill(ids < 0, self.token_id)  # the image token's embedding, then overwritten
        return {"inputs_embeds": merged_embeddings(self.model, plain, placed, self.pixels, start)}


def keyed_prompt(vision: EngineVision | None, input_ids: list[int], images: Images) -> list[int]:
    """A request's prompt as the engine keeps it: keyed when it has images (module docstring); a ValueError when
    images come to a text model, or a vision-language prompt's image tokens come without their images."""
    if vision is None:
        if images:
            raise ValueError(f"{len(images)} images came with a prompt, but this engine's model takes no images")
        return input_ids
    if images:
        return vision.keyed(input_ids, images)
    if vision.token_id in input_ids:
        raise ValueError("the prompt holds image tokens but no images came with it: pass them as `images`")
    return input_ids
