"""Token log-probabilities and entropies straight from hidden states, never holding [tokens x vocab] logits.

Why: with a 49k vocabulary the LM head's output dominates a small model's training memory. 4096 trained
tokens give 800 MB of fp32 logits, and autograd keeps several tensors of that size (the logits, their
log-softmax, the bf16 copy under autocast) until backward. Here the LM head runs over chunks of rows: each
chunk's logits live only while its log-softmax, target gather and entropy are taken, and backward recomputes
them one chunk at a time (one extra LM-head matmul, the price of activation checkpointing the head). Peak
memory for the head is then one chunk, whatever the batch.

The gradient is written out by hand. With z = logits / T, p = softmax(z), lp = log p:
    d lp[t] / d z = onehot(t) - p
    d H / d z     = -p * (lp + H)            (H = -sum p lp)
and d/d logits = (d/d z) / T. Under CPU/CUDA autocast the matmuls run in the autocast dtype, as the
plain `lm_head(hidden)` would; softmax arithmetic is always fp32.
"""

from __future__ import annotations

import torch

CHUNK_BYTES = 32 * 2**20  # fp32 bytes of one chunk's logits: ~170 rows of a 49k vocabulary


def chunk_rows(vocab: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    return max(1, chunk_bytes // (4 * vocab))


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                   temperature: float = 1.0, with_entropy: bool = False, entropy_grad: bool = False,
                   chunk_bytes: int = CHUNK_BYTES) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(hidden @ weight.T / temperature)[targets] per row, and the entropy per row if asked.

    hidden [N, H], weight [V, H] (the LM head, no bias), targets [N] -> logp [N] (fp32), entropy [N] or None.
    Gradients flow to hidden and weight through logp, and through the entropy only when entropy_grad.
    """
    rows = chunk_rows(weight.shape[0], chunk_bytes)
    inv_t = 1.0 / temperature if temperature > 0 else 1.0
    if not torch.is_grad_enabled() or not (hidden.requires_grad or weight.requires_grad):
        return _forward(hidden, weight, targets, inv_t, rows, with_entropy)
    logp, entropy = _ChunkedLogprobs.apply(hidden, weight, targets, inv_t, rows, with_entropy, entropy_grad)
    return logp, entropy if with_entropy else None


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, inv_t: float) -> torch.Tensor:
    """fp32 z = h @ W.T / T for one chunk (the matmul itself in the autocast dtype when autocast is on)."""
    z = (h @ weight.t()).float()
    return z.mul_(inv_t) if inv_t != 1.0 else z


@torch.no_grad()
def _forward(hidden, weight, targets, inv_t, rows, with_entropy):
    """Per-chunk logsumexp, target logprob and entropy; returns (logp, entropy or None) and nothing else."""
    n = hidden.shape[0]
    logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
    entropy = torch.empty(n, dtype=torch.float32, device=hidden.device) if with_entropy else None
    for s in range(0, n, rows):
        z = _chunk_logits(hidden[s: s + rows], weight, inv_t)
        lse = torch.logsumexp(z, dim=-1)
        logp[s: s + rows] = z.gather(-1, targets[s: s + rows, None]).squeeze(-1) - lse
        if entropy is not None:  # H = lse - sum p z, with p = exp(z - lse) computed in place
            entropy[s: s + rows] = lse - (z.sub(lse[:, None]).exp_() * z).sum(-1)
    return logp, entropy


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_t, rows, with_entropy, entropy_grad):
        device = hidden.device.type  # backward runs outside the caller's autocast: it is restored from here
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        logp, entropy = _forward(hidden, weight, targets, inv_t, rows, with_entropy)
        if entropy is None:
            entropy = logp.new_zeros(0)
        ctx.save_for_backward(hidden, weight, targets, entropy)
        ctx.inv_t, ctx.rows, ctx.entropy_grad = inv_t, rows, with_entropy and entropy_grad
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        device, enabled, dtype = ctx.autocast
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            return _backward(ctx, grad_logp, grad_entropy)


def _backward(ctx, grad_logp, grad_entropy):
    """Recompute each chunk's softmax and push its gradient into hidden and weight (formulas: module doc)."""
    hidden, weight, targets, entropy = ctx.saved_tensors
    g_h = grad_entropy if ctx.entropy_grad else None
    grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
        if ctx.needs_input_grad[1] else None
    autocast = torch.is_autocast_enabled(hidden.device.type)
    for s in range(0, hidden.shape[0], ctx.rows):
        rows = slice(s, s + ctx.rows)
        dz = _chunk_grad_logits(hidden[rows], weight, targets[rows], ctx.inv_t, grad_logp[rows],
                                None if g_h is None else (entropy[rows], g_h[rows]))
        if not autocast:  # autocast casts the matmul operands itself (and caches the weight's cast)
            dz = dz.to(weight.dtype)
        if grad_hidden is not None:
            grad_hidden[rows] = dz @ weight
        if grad_weight is not None:
            grad_weight += dz.t() @ hidden[rows]
    if grad_weight is not None:
        grad_weight = grad_weight.to(weight.dtype)
    return grad_hidden, grad_weight, None, None, None, None, None


def _chunk_grad_logits(h, weight, targets, inv_t, g_lp, entropy_part):
    """d loss / d logits [rows, vocab] in fp32 for one chunk: g_lp * (onehot - p) [- g_H * p * (lp + H)], / T."""
    lp = _chunk_logits(h, weight, inv_t)
    lp.sub_(torch.logsumexp(lp, dim=-1, keepdim=True))
    p = lp.exp()
    g = g_lp[:, None]
    dz = p.mul(-g)
    dz.scatter_add_(-1, targets[:, None], g)
    if entropy_part is not None:
        entropy, g_ent = entropy_part
        dz.sub_(p.mul_(lp.add_(entropy[:, None])).mul_(g_ent[:, None]))
    return dz.mul_(inv_t) if inv_t != 1.0 else dz
