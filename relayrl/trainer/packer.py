"""`Packer`: turn samples into padded micro-batches under a token budget.

This is the one place where samples become tensors. Samples are laid out in rows (one per row, or a
GRPO group sharing one copy of its prompt), rows are sorted by length (longest first) and cut into
micro-batches whose padded size (rows x longest row) stays under `max_tokens`, which keeps padding
low. Attention never crosses sequences. Per-token training data (logprobs, advantages, weights) is
kept per sample and gathered per micro-batch in the same order as the targets.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from relayrl.models.moe import NO_ROUTE
from relayrl.models.segments import SegmentLayout, segment_layout
from relayrl.sample import Sample
from relayrl.trainer.vision import RowImages, prompt_key, row_images


@dataclass
class MicroBatch:
    sample_idx: list[int]  # indices into TrainBatch.samples, in target order
    input_ids: torch.Tensor  # [rows, L], right-padded
    attention_mask: torch.Tensor  # [rows, L] padding mask, or [rows, 1, L, L] bool for shared-prompt rows
    rows: torch.Tensor  # [N] row of each trained token
    cols: torch.Tensor  # [N] position whose logits predict that token
    targets: torch.Tensor  # [N] the trained token ids
    position_ids: torch.Tensor | None = None  # [rows, L] when rows hold several sequences
    real_tokens: int = 0  # non-padding positions (each shared prompt counted once)
    layout: SegmentLayout | None = None  # shared-prompt rows: attention without the dense mask (models.segments)
    # MoE samples' routed experts [rows, L, MoE layers, k] laid out as input_ids (NO_ROUTE where none is recorded:
    # padding, a row's last token); the forward replays them under algo.routing_replay (relayrl.trainer.routing)
    routed: torch.Tensor | None = None
    # vision-language samples: each row's prompt tokens and images (relayrl.trainer.vision); None: no images
    images: RowImages | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.targets.numel())

    @property
    def padded_tokens(self) -> int:
        return int(self.input_ids.numel())

    def to(self, device: torch.device | str) -> MicroBatch:
        """This micro-batch with its tensors on `device`. Packing happens on the CPU (Python lists to tensors);
        engines move each micro-batch to their model's device just before its forward. On the CPU: itself."""
        if torch.device(device).type == "cpu":
            return self
        moved = {f.name: getattr(self, f.name).to(device, non_blocking=True) for f in dataclasses.fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor)}
        return dataclasses.replace(self, **moved, layout=self.layout and self.layout.to(device))


@dataclass
class TrainBatch:
    """Samples plus per-sample, per-trained-token tensors filled in by the TrainController steps."""

    samples: list[Sample]
    micro_batches: list[MicroBatch]
    per_token: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # key -> one tensor per sample

    @property
    def lengths(self) -> list[int]:
        return [s.num_trained_tokens for s in self.samples]

    def gather(self, key: str, mb: MicroBatch) -> torch.Tensor | None:
        """Concatenate one per-token field over the samples of a micro-batch (None if absent)."""
        if key not in self.per_token:
            return None
        return torch.cat([self.per_token[key][i] for i in mb.sample_idx])

    def scatter(self, key: str, mb: MicroBatch, values: torch.Tensor) -> None:
        """Store a flat per-token tensor computed on a micro-batch back per sample."""
        store = self.per_token.setdefault(key, [torch.zeros(0)] * len(self.samples))
        sizes = [self.samples[i].num_trained_tokens for i in mb.sample_idx]
        for i, part in zip(mb.sample_idx, values.split(sizes)):
            store[i] = part

    def flat(self, key: str) -> torch.Tensor:
        return torch.cat(self.per_token[key]) if self.per_token.get(key) else torch.zeros(0)


class Packer:
    """Lay samples out in rows and rows in micro-batches of at most `max_tokens` padded tokens.

    With `share_prompt`, samples with the same prompt (a GRPO group) share one copy of it in a row:
    [prompt, response 1, response 2, ...], where each response attends to the prompt and to itself
    only, at the positions it had when it was generated. The prompt's forward and backward then run
    once per row instead of once per sample, with the same logprobs and gradients.
    """

    def __init__(self, max_tokens: int, pad_id: int, share_prompt: bool = False, row_tokens: int = 1024):
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens, self.pad_id = max_tokens, pad_id
        self.share_prompt, self.row_tokens = share_prompt, row_tokens

    def plan(self, lengths: list[int]) -> list[list[int]]:
        """Group indices so that rows * longest row <= max_tokens (a longer row gets its own group)."""
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        groups: list[list[int]] = []
        for i in order:
            if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= self.max_tokens:
                groups[-1].append(i)
            else:
                groups.append([i])
        return groups

    def rows(self, samples: list[Sample]) -> list[list[int]]:
        """Sample indices per row: one sample per row, or same-prompt samples up to `row_tokens`."""
        if not self.share_prompt:
            return [[i] for i in range(len(samples))]
        by_prompt: dict[tuple, list[int]] = {}
        for i, s in enumerate(samples):
            by_prompt.setdefault(prompt_key(s), []).append(i)  # same tokens and same images
        rows: list[list[int]] = []
        for idx in by_prompt.values():
            row: list[int] = []
            for i in idx:
                if row and _row_len(samples, row) + len(samples[i].response_ids) > self.row_tokens:
                    rows.append(row)
                    row = []
                row.append(i)
            rows.append(row)
        return rows

    def pack(self, samples: list[Sample]) -> TrainBatch:
        rows = self.rows(samples)
        plan = self.plan([_row_len(samples, r) for r in rows])
        return TrainBatch(samples, [self._micro_batch(samples, [rows[i] for i in g]) for g in plan])

    def _micro_batch(self, samples: list[Sample], rows: list[list[int]]) -> MicroBatch:
        width = max(_row_len(samples, r) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        segment = torch.full((len(rows), width), -1, dtype=torch.long)  # -1 pad, 0 prompt, j>0 response j
        positions = torch.zeros((len(rows), width), dtype=torch.long)
        r_idx, cols, targets, order = [], [], [], []
        prompt_lens, spans = [], []  # per row: prompt length, (start, length) of each response
        for r, row in enumerate(rows):
            prompt = samples[row[0]].prompt_ids
            p = len(prompt)
            input_ids[r, :p] = torch.tensor(prompt)
            segment[r, :p] = 0
            positions[r, :p] = torch.arange(p)
            start = p
            prompt_lens.append(p)
            spans.append([])
            for j, i in enumerate(row, 1):
                resp, mask = samples[i].response_ids, samples[i].loss_mask
                n = len(resp)
                input_ids[r, start: start + n] = torch.tensor(resp, dtype=torch.long)
                segment[r, start: start + n] = j
                positions[r, start: start + n] = torch.arange(p, p + n)
                for t in range(n):
                    if mask[t]:  # token t is predicted by the prompt's last token (t = 0) or by token t - 1
                        r_idx.append(r)
                        cols.append(p - 1 if t == 0 else start + t - 1)
                        targets.append(resp[t])
                order.append(i)
                spans[-1].append((start, n))
                start += n
        shared = any(len(row) > 1 for row in rows)
        mask = _segment_mask(segment) if shared else (segment >= 0).long()
        return MicroBatch(order, input_ids, mask, torch.tensor(r_idx, dtype=torch.long),
                          torch.tensor(cols, dtype=torch.long), torch.tensor(targets, dtype=torch.long),
                          positions if shared else None, int((segment >= 0).sum()),
                          segment_layout(prompt_lens, spans, width) if shared else None,
                          routed_layout(samples, rows, width), row_images(samples, rows))


def routed_layout(samples: list[Sample], rows: list[list[int]], width: int) -> torch.Tensor | None:
    """The samples' routed experts where their tokens sit in the rows (as `_micro_batch` lays them out): a shared
    prompt's from the row's first sample (group members share its prefill in the engine), each response's from its
    own sample. None when no sample has any (a dense model)."""
    have = [samples[i].routed_experts for row in rows for i in row if samples[i].routed_experts is not None]
    if not have:
        return None
    out = torch.full((len(rows), width, *have[0].shape[1:]), NO_ROUTE, dtype=torch.int16)
    for r, row in enumerate(rows):
        p = len(samples[row[0]].prompt_ids)
        _put(out[r, :p], samples[row[0]].routed_experts, 0)
        start = p
        for i in row:
            n = len(samples[i].response_ids)
            _put(out[r, start: start + n], samples[i].routed_experts, p)
            start += n
    return out


def _put(dst: torch.Tensor, routed: np.ndarray | None, first: int) -> None:
    """dst[j] = routed[first + j] where recorded (an engine call records all but its last position)."""
    if routed is not None:
        part = routed[first: first + dst.shape[0]]
        dst[: part.shape[0]] = torch.from_numpy(part.astype(np.int16))


def _row_len(samples: list[Sample], row: list[int]) -> int:
    return len(samples[row[0]].prompt_ids) + sum(len(samples[i].response_ids) for i in row)


def _segment_mask(segment: torch.Tensor) -> torch.Tensor:
    """[rows, 1, L, L] bool: causal, and a key is visible if it is prompt or in the query's own response.

    Padding queries see only themselves, which keeps their (unused) outputs finite: a fully masked row
    would give NaN, and NaN times a zero gradient is still NaN in the weight gradients.
    """
    n = segment.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool).tril_()
    q, k = segment[:, :, None], segment[:, None, :]
    visible = causal & ((k == 0) | (k == q)) & (q >= 0) & (k >= 0)
    return (visible | torch.eye(n, dtype=torch.bool))[:, None]


@dataclass
class RankSplit:
    """Which micro-batches each data-parallel rank trains, and what the split costs."""

    ranks: list[list[int]]  # micro-batch indices per rank, in batch order
    steps: int  # forward/backward steps every rank runs: FSDP collectives need the same count on all ranks
    stats: dict[str, float]


def balance_ranks(micro_batches: list[MicroBatch], world_size: int) -> RankSplit:
    """Assign micro-batches to ranks so padded token counts (compute) balance: greedy, largest first.

    A step lasts as long as its busiest rank, so the split minimises the largest load; among equal
    loads it picks the rank with fewer micro-batches, since a rank with fewer must run empty steps to
    keep FSDP's collectives in lockstep. The split depends only on the micro-batches, so every rank
    computes the same one without talking to the others.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for i in sorted(range(len(micro_batches)), key=lambda i: -micro_batches[i].padded_tokens):
        r = min(range(world_size), key=lambda r: (loads[r], len(ranks[r]), r))
        ranks[r].append(i)
        loads[r] += micro_batches[i].padded_tokens
    steps = max(len(r) for r in ranks)
    padded, real = sum(loads), sum(mb.real_tokens for mb in micro_batches)
    busiest = max(loads)
    stats = {"pad_frac": 1.0 - real / padded if padded else 0.0,  # padding inside micro-batches
             "dp_idle_frac": 1.0 - padded / (busiest * world_size) if busiest else 0.0,  # waiting on the busiest
             "dp_imbalance": busiest * world_size / padded if padded else 1.0,  # 1.0 = perfectly balanced
             "dp_empty_steps": float(steps * world_size - len(micro_batches))}
    return RankSplit([sorted(r) for r in ranks], steps, stats)
