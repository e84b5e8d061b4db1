"""Batched token sampling with per-row settings and per-row random streams.

Each row draws ONE uniform number u from its own generator and takes the first token whose cumulative
probability exceeds u * total (inverse-CDF sampling, in two levels: block sums, then inside one block).
Drawing u from a per-request generator makes a seeded request sample the same tokens whatever other
requests share its batch, which keeps runs reproducible when the continuous batch changes shape. One number
per row, instead of a noise value per vocabulary entry (the Gumbel-max trick), is what makes sampling cheap
next to the forward: with 256 rows and a 49k vocabulary the Gumbel noise alone cost more than the rest of
sampling (bench/engine.py rollout, docs/benchmarks.md, "Rollout speed").

Devices: the arithmetic runs on the logits' device, but the uniforms are drawn on the CPU, from CPU generators,
and moved there (one number per row). So a seeded request samples the same u on a CPU and on a GPU engine, and
the engine's generator state is one CPU ByteTensor that a checkpoint saves and restores anywhere; a CUDA
generator per request would also have to live on the engine's device and be re-created when it moves.
"""

from __future__ import annotations

import torch

from relayrl.engine.base import SamplingParams

_BLOCK = 256  # vocabulary entries per first-level block of _inverse_cdf


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


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of unnormalised `weights` [rows, vocab], the first token whose cumulative weight exceeds u * total.

    Two levels, because a cumulative sum over a 49k vocabulary is a slow sequential scan: sums of blocks of
    _BLOCK tokens (a fast reduction) pick the block, then a short scan inside it picks the token. A token of
    weight 0 adds nothing to either sum, so it can never be the first to exceed the target.
    """
    rows, vocab = weights.shape
    full = vocab // _BLOCK * _BLOCK
    sums = weights[:, :full].reshape(rows, -1, _BLOCK).sum(-1)
    if full < vocab:
        sums = torch.cat([sums, weights[:, full:].sum(-1, keepdim=True)], dim=1)
    cdf = sums.cumsum(dim=-1)
    total = cdf[:, -1]
    target = torch.minimum(u * total, total * (1 - 1e-6))  # stay below the total despite rounding
    block = torch.searchsorted(cdf, target[:, None], right=True).squeeze(-1).clamp_(max=cdf.shape[1] - 1)
    before = torch.where(block > 0, cdf.gather(1, (block - 1).clamp(min=0)[:, None]).squeeze(-1), 0.0)
    cols = block[:, None] * _BLOCK + torch.arange(_BLOCK, device=weights.device)
    inside = weights.gather(1, cols.clamp(max=vocab - 1)).masked_fill_(cols >= vocab, 0.0).cumsum(dim=-1)
    rest = torch.minimum(target - before, inside[:, -1] * (1 - 1e-6))  # the two sums may round differently
    return block * _BLOCK + torch.searchsorted(inside, rest[:, None], right=True).squeeze(-1).clamp_(max=_BLOCK - 1)


def sample_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator,
    work: torch.Tensor | None = None,
) -> tuple[list[int], list[float], list[list[tuple[int, float]]] | None]:
    """Sample one token per row of `logits` [rows, vocab]; return tokens, their logprobs and, when some row's params
    ask for top_logprobs, each row's most likely (token, logprob) pairs (None otherwise: no cost for the others).

    The logprob is log_softmax(logits / T)[token] (T = 1 for greedy rows), i.e. before top-k/top-p, computed
    in fp32 as (logit - max) / T - log(sum(exp((logits - max) / T))). `work`, a float32 tensor on the logits'
    device of at least rows * vocab elements kept (and grown) by the caller, holds the probabilities: a fresh
    50 MB tensor (256 x 49k fp32) every decode step costs more in page faults than the arithmetic
    (docs/benchmarks.md, "Rollout speed"). Which branches run is decided from `params` in Python, so a GPU step does not
    wait on the device to learn them.
    """
    device = logits.device
    temp_list = [1.0 if p.greedy else p.temperature for p in params]
    greedy_list = [p.greedy for p in params]
    temps = torch.tensor(temp_list, device=device)
    top = logits.max(dim=-1, keepdim=True).values.float()
    if work is None:
        work = torch.empty(logits.numel(), device=device)
    weights = work[: logits.numel()].view(logits.shape).copy_(logits).sub_(top)
    if any(t != 1 for t in temp_list):
        weights.div_(temps[:, None])
    weights.exp_()  # exp((logits - max) / T): unnormalised probabilities, at most 1
    if all(greedy_list):
        tokens = logits.argmax(dim=-1)
    else:
        filtered = weights
        if any(p.top_k > 0 or p.top_p < 1 for p in params):
            top_k = torch.tensor([p.top_k for p in params], device=device)
            top_p = torch.tensor([p.top_p for p in params], device=device)
            scaled = logits.float() / temps[:, None]
            filtered = _filter_top_k_top_p(scaled, top_k, top_p).softmax(dim=-1)
        u = _uniforms(len(params), generators, default_generator).to(device)
        tokens = _inverse_cdf(filtered, u)
        if any(greedy_list):
            tokens = torch.where(torch.tensor(greedy_list, device=device), logits.argmax(dim=-1), tokens)
    log_total = weights.sum(dim=-1).log()
    chosen = (logits.gather(-1, tokens[:, None]).squeeze(-1).float() - top.squeeze(-1)) / temps
    chosen -= log_total
    alternatives = _alternatives(logits, params, top, temps, log_total) if any(p.top_logprobs for p in params) else None
    return tokens.tolist(), chosen.tolist(), alternatives


def _alternatives(logits: torch.Tensor, params: list[SamplingParams], top: torch.Tensor, temps: torch.Tensor,
                  log_total: torch.Tensor) -> list[list[tuple[int, float]]]:
    """The params.top_logprobs most likely (token, logprob) of each row that asks (others: []), most likely first,
    in the very arithmetic of the sampled token's logprob, so a sampled token among them has the same value."""
    asking = [i for i, p in enumerate(params) if p.top_logprobs]
    rows = torch.tensor(asking, device=logits.device)
    k = min(max(params[i].top_logprobs for i in asking), logits.shape[-1])
    values, ids = logits.index_select(0, rows).topk(k, dim=-1)  # the order of logits is the order of logprobs
    lps = (values.float() - top.index_select(0, rows)) / temps.index_select(0, rows)[:, None]
    lps -= log_total.index_select(0, rows)[:, None]
    out: list[list[tuple[int, float]]] = [[] for _ in params]
    for i, row_ids, row_lps in zip(asking, ids.tolist(), lps.tolist()):
        out[i] = list(zip(row_ids, row_lps))[: params[i].top_logprobs]
    return out

