"""Prefill for LocalEngine: many prompts in one forward, and the start they share computed once.

Why: a prefill is a forward over a prompt's tokens, so one prompt at a time its matmuls have as many rows as the
prompt has tokens (~50 in the README job), where a CPU's fp32 GEMM runs far below its rate; several prompts in one
forward give it enough rows to approach it, so each prompt's share of the time falls as they are batched
(bench/engine.py prefill; docs/benchmarks.md, "Prefill in batches, the shared start once").
Prompts that arrive together also share their start (the system prompt and chat-template tokens: 20 of the README
job's 49), which is computed once, in the first prompt's slot, and copied to the others' slots. The last such start
is kept (`SharedStart`, one entry, ~1 MB at 135M) for prompts admitted later, one or two at a time as running
sequences finish; the engine clears it whenever its weights change. A prompt with images holds its images' key in
place of its image tokens (relayrl.engine.vision), so prompts share a start only up to an image they do not share.

Rows are right-padded to the longest in their forward. That needs no padding mask: a real query attends only to
earlier positions, and the padding positions all come after its row's real tokens (their keys/values land in the
slot beyond the row's length, where the next decode step overwrites them and no mask ever reaches them). Rows
are sorted by length and cut into forwards of at most `token_budget` padded tokens, which bounds the activations
and attention scores of a forward however many prompts arrive.

The first token's logits come from the LM head applied to each row's last real position only: logits are
`head(decoder(x))` as for every model relayrl trains (the trainer's logprobs assume the same).
"""

from __future__ import annotations

import torch

from relayrl.engine.kv_cache import SlotKVCache
from relayrl.engine.vision import EngineVision

MIN_SHARED = 8  # shorter shared starts are not worth a separate forward


class SharedStart:
    """The tokens and KV (all layers, as SlotKVCache.export gives them) of the last start several prompts shared."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.kv: list[torch.Tensor] = []

    def clear(self) -> None:
        self.tokens, self.kv = [], []

    def begins(self, rows: list[list[int]]) -> bool:
        """Whether every row begins with the kept start and has at least one token after it."""
        n = len(self.tokens)
        return n > 0 and all(len(r) > n and r[:n] == self.tokens for r in rows)


def common_prefix(rows: list[list[int]]) -> int:
    """Length of the start all rows share."""
    first, n = rows[0], min(len(r) for r in rows)
    for other in rows[1:]:
        i = 0
        while i < n and other[i] == first[i]:
            i += 1
        n = i
    return n


def prefill(model: torch.nn.Module, cache: SlotKVCache, rows: list[list[int]], slots: list[int], start: int = 0,
            token_budget: int = 2048, kept: SharedStart | None = None,
            vision: EngineVision | None = None) -> tuple[torch.Tensor, int]:
    """Write the keys/values of rows[i][start:] into slot slots[i] (positions < start are already there) and return
    the logits of each row's last position [n, vocab] (float32, in `rows` order) and the tokens run through the model.

    With start == 0 and several rows, their shared start (if at least MIN_SHARED tokens, and never a whole row: its
    last position's logits are needed) is run once in slots[0] and copied into the other slots, and kept in `kept`;
    rows that all begin with the start `kept` holds get its KV copied in instead. token_budget 0: one row per forward
    and no shared start (how LocalEngine prefilled before; kept to compare with). `vision`: a vision-language
    model's, whose rows may hold image keys (relayrl.engine.vision): those forwards run on merged embeddings."""
    computed = 0
    if start == 0 and token_budget > 0:
        start, computed = _shared_start(model, cache, rows, slots, kept or SharedStart(), vision)
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]), reverse=True)
    out: list[torch.Tensor | None] = [None] * len(rows)
    i = 0
    while i < len(order):
        width = len(rows[order[i]]) - start  # the longest row left sets this forward's width
        take = order[i: i + max(1, token_budget // width)]  # budget 0: one row per forward
        logits = _forward(model, cache, [rows[j] for j in take], [slots[j] for j in take], start, vision=vision)
        for j, row_logits in zip(take, logits):
            out[j] = row_logits
        computed += sum(len(rows[j]) - start for j in take)
        i += len(take)
    return torch.stack(out), computed


def _shared_start(model: torch.nn.Module, cache: SlotKVCache, rows: list[list[int]], slots: list[int],
                  kept: SharedStart, vision: EngineVision | None) -> tuple[int, int]:
    """Fill every slot's first positions with the rows' shared start: from `kept`, or computed once (and kept).
    Returns (positions filled, tokens computed)."""
    if kept.begins(rows):
        for slot in slots:
            cache.restore(slot, kept.kv)
        return len(kept.tokens), 0
    shared = min(common_prefix(rows), min(len(r) for r in rows) - 1) if len(rows) > 1 else 0
    if shared < MIN_SHARED:
        return 0, 0
    _forward(model, cache, [rows[0][:shared]], [slots[0]], 0, logits=False, vision=vision)
    for slot in slots[1:]:
        cache.copy_slot(slots[0], slot, shared)
    kept.tokens, kept.kv = rows[0][:shared], cache.export(slots[0], shared)
    return shared, shared


def _forward(model: torch.nn.Module, cache: SlotKVCache, rows: list[list[int]], slots: list[int], start: int,
             logits: bool = True, vision: EngineVision | None = None) -> torch.Tensor | None:
    """One forward of rows[:, start:], right-padded, into `slots`; the last real position's logits per row."""
    dev = cache.device
    lengths = [len(r) - start for r in rows]
    width = max(lengths)
    ids = torch.tensor([r[start:] + [r[-1]] * (width - n) for r, n in zip(rows, lengths)], device=dev)
    cache.prefill_into(slots, start)
    causal = torch.ones(width, start + width, dtype=torch.bool, device=dev).tril_(diagonal=start)
    inputs = {"input_ids": ids} if vision is None else vision.inputs(ids, rows, start)  # images: merged embeddings
    hidden = model.get_decoder()(
        **inputs, position_ids=torch.arange(start, start + width, device=dev)[None].expand(len(rows), -1),
        attention_mask=causal[None, None].expand(len(rows), 1, -1, -1), cache=cache,
        use_cache=True).last_hidden_state
    if not logits:
        return None
    last = hidden[torch.arange(len(rows), device=dev), torch.tensor(lengths, device=dev) - 1]
    return model.get_output_embeddings()(last).float()
