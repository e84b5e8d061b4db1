"""Batched token sampling with per-row settings and per-row random streams.

Sampling uses the Gumbel-max trick: argmax(logits / T + Gumbel noise) is a sample from
softmax(logits / T). Drawing the noise from a per-request generator makes a seeded request sample
the same tokens whatever other requests share its batch, which keeps runs reproducible when the
continuous batch changes shape.
"""

from __future__ import annotations

import torch

from relayrl.engine.base import SamplingParams


def _filter_top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k / nucleus to -inf (rows with k=0 and p=1 are untouched)."""
    vocab = scaled.shape[-1]
    sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=scaled.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    drop = ranks >= k[:, None]
    probs = sorted_logits.softmax(dim=-1)
    # keep a token while the mass *before* it is < top_p, so the top token is always kept
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(-1, sorted_idx, sorted_logits)


def _gumbel_noise(shape: tuple[int, int], generators: list[torch.Generator | None],
                  default: torch.Generator) -> torch.Tensor:
    if all(g is None for g in generators):
        u = torch.rand(shape, generator=default)
    else:
        u = torch.stack([torch.rand(shape[1], generator=g or default) for g in generators])
    return -torch.log(-torch.log(u.clamp_(1e-20, 1.0 - 1e-7)))


def sample_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator,
) -> tuple[list[int], list[float]]:
    """Sample one token per row of `logits` [rows, vocab]; return tokens and their logprobs.

    The logprob is log_softmax(logits / T)[token] (T = 1 for greedy rows), i.e. before top-k/top-p.
    """
    logits = logits.float()
    temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params])
    scaled = logits / temps[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)
    greedy = torch.tensor([p.greedy for p in params])
    if bool(greedy.all()):
        tokens = scaled.argmax(dim=-1)
    else:
        top_k = torch.tensor([p.top_k for p in params])
        top_p = torch.tensor([p.top_p for p in params])
        filtered = scaled
        if bool((top_k > 0).any() or (top_p < 1).any()):
            filtered = _filter_top_k_top_p(scaled, top_k, top_p)
        noisy = filtered + _gumbel_noise(tuple(scaled.shape), generators, default_generator)
        tokens = torch.where(greedy, scaled.argmax(dim=-1), noisy.argmax(dim=-1))
    chosen = logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens.tolist(), chosen.tolist()
