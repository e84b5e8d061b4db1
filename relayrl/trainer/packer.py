"""`Packer`: turn samples into padded micro-batches under a token budget.

This is the one place where samples become tensors. Sequences are sorted by length (longest first)
and cut into micro-batches whose padded size (rows x longest row) stays under `max_tokens`, which
keeps padding low without cross-sequence attention. Per-token training data (logprobs, advantages,
weights) is kept per sample and gathered per micro-batch in the same order as the targets.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from relayrl.sample import Sample


@dataclass
class MicroBatch:
    sample_idx: list[int]  # indices into TrainBatch.samples, in row order
    input_ids: torch.Tensor  # [rows, L], right-padded
    attention_mask: torch.Tensor  # [rows, L]
    rows: torch.Tensor  # [N] row of each trained token
    cols: torch.Tensor  # [N] position whose logits predict that token
    targets: torch.Tensor  # [N] the trained token ids

    @property
    def num_tokens(self) -> int:
        return int(self.targets.numel())

    @property
    def padded_tokens(self) -> int:
        return int(self.input_ids.numel())


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
    def __init__(self, max_tokens: int, pad_id: int):
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens, self.pad_id = max_tokens, pad_id

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

    def pack(self, samples: list[Sample]) -> TrainBatch:
        groups = self.plan([len(s.input_ids) for s in samples])
        return TrainBatch(samples, [self._micro_batch(samples, g) for g in groups])

    def _micro_batch(self, samples: list[Sample], idx: list[int]) -> MicroBatch:
        seqs = [samples[i].input_ids for i in idx]
        width = max(len(s) for s in seqs)
        input_ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(seqs), width), dtype=torch.long)
        rows, cols, targets = [], [], []
        for r, i in enumerate(idx):
            s = samples[i]
            seq = s.input_ids
            input_ids[r, : len(seq)] = torch.tensor(seq)
            attention_mask[r, : len(seq)] = 1
            p = len(s.prompt_ids)
            for j, (tok, m) in enumerate(zip(s.response_ids, s.loss_mask)):
                if m:
                    rows.append(r)
                    cols.append(p + j - 1)
                    targets.append(tok)
        return MicroBatch(idx, input_ids, attention_mask, torch.tensor(rows, dtype=torch.long),
                          torch.tensor(cols, dtype=torch.long), torch.tensor(targets, dtype=torch.long))
