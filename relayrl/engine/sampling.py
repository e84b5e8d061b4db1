"""Batched token sampling with per-row settings and per-row random streams.

Each row draws ONE uniform number u from its own generator and takes the first token whose cumulative
probability exceeds u * total (inverse-CDF sampling). Drawing u from a per-request generator makes a seeded
request sample the same tokens whatever other requests share its batch, which keeps runs reproducible when
the continuous batch changes shape. One number per row, instead of a noise value per vocabulary entry (the
Gumbel-max trick), is what makes sampling cheap next to the forward: with 256 rows and a 49k vocabulary the
Gumbel noise alone cost more than the rest of sampling (bench/rollout.py, docs/benchmarks.md).
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


def _uniforms(rows: int, generators: list[torch.Generator | None], default: torch.Generator) -> torch.Tensor:
    """One U[0, 1) number per row, from the row's own generator when it has one."""
    if all(g is None for g in generators):
        return torch.rand(rows, generator=default)
    return torch.cat([torch.rand(1, generator=g or default) for g in generators])


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative probability exceeds u * total: a token of probability 0
    adds nothing to the cumulative sum, so it can never be the first to exceed it."""
    cdf = probs.cumsum(dim=-1)
    target = (u * cdf[:, -1]).clamp_(max=cdf[:, -1] * (1 - 1e-6))  # stay below the total despite rounding
    return torch.searchsorted(cdf, target[:, None], right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def sample_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator,
) -> tuple[list[int], list[float]]:
    """Sample one token per row of `logits` [rows, vocab]; return tokens and their logprobs.

    The logprob is log_softmax(logits / T)[token] (T = 1 for greedy rows), i.e. before top-k/top-p.
    """
    temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params])
    scaled = logits.float() if bool((temps == 1).all()) else logits.float() / temps[:, None]
    # log(softmax) rather than log_softmax: one pass less, and fp32 keeps a sampled token's log-probability
    # to ~1e-7 (a token too unlikely for that can only be chosen by argmax, which picks the likeliest)
    probs = torch.softmax(scaled, dim=-1)
    greedy = torch.tensor([p.greedy for p in params])
    if bool(greedy.all()):
        tokens = scaled.argmax(dim=-1)
    else:
        top_k = torch.tensor([p.top_k for p in params])
        top_p = torch.tensor([p.top_p for p in params])
        filtered = probs
        if bool((top_k > 0).any() or (top_p < 1).any()):
            filtered = _filter_top_k_top_p(scaled, top_k, top_p).softmax(dim=-1)
        tokens = _inverse_cdf(filtered, _uniforms(len(params), generators, default_generator))
        if bool(greedy.any()):
            tokens = torch.where(greedy, scaled.argmax(dim=-1), tokens)
    chosen = probs.gather(-1, tokens[:, None]).squeeze(-1).log()
    return tokens.tolist(), chosen.tolist()
