"""Token log-probabilities and entropies straight from hidden states, never holding [tokens x vocab] logits.

Why: with a 49k vocabulary the LM head's output dominates a small model's training memory. 4096 trained
tokens give 800 MB of fp32 logits, and autograd keeps several tensors of that size (the logits, their
log-softmax, the bf16 copy under autocast) until backward. Here the LM head runs over chunks of rows: each
chunk's logits live only while its log-softmax, target gather and entropy are taken; backward recomputes them
in blocks of vocabulary columns (one extra LM-head matmul, the price of checkpointing the head), so each block of
the weight gradient is written once. Peak memory for the head is one chunk or block, whatever the batch.

The gradient is written out by hand. With z = logits / T, p = softmax(z), lp = log p:
    d lp[t] / d z = onehot(t) - p
    d H / d z     = -p * (lp + H)            (H = -sum p lp)
and d/d logits = (d/d z) / T. Under CPU/CUDA autocast the matmuls run in the autocast dtype, as the
plain `lm_head(hidden)` would; softmax arithmetic is always fp32.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.distributed as dist

CHUNK_BYTES = 32 * 2**20  # fp32 bytes of one chunk's logits: ~170 rows of a 49k vocabulary


def chunk_rows(vocab: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    return max(1, chunk_bytes // (4 * vocab))


def working_bytes(vocab: int, rows: int = 4096, entropy_grad: bool = False) -> int:
    """The head's peak working memory beyond its outputs and gradients (tested): one fp32 chunk or block of
    logits, two when the entropy is differentiated. For the benches' memory breakdowns."""
    return (2 if entropy_grad else 1) * min(CHUNK_BYTES, 4 * vocab * rows)


_INTO_GRAD: contextvars.ContextVar[bool] = contextvars.ContextVar("relayrl_head_grad_into_param", default=False)


@contextlib.contextmanager
def weight_grad_into_param():
    """Inside, the head's backward adds its weight gradient block by block straight into `weight.grad` (and the input
    embedding's backward its rows: relayrl.trainer.embedding), for code that calls `loss.backward()` (never
    `torch.autograd.grad`, which would then get no weight gradient).

    Why: autograd hands a leaf its gradient only when every use of it has sent one. A tied LM head's weight is
    also the input embedding, used first in forward and so reached last in backward: the head's whole
    [vocab x hidden] gradient (113 MB at SmolLM2-135M) would wait in autograd's buffer through the backward of
    every layer, on top of the step's peak; written into the parameter at once, it never does (bench/scaling.py;
    docs/benchmarks.md, "Scaling with model size")."""
    token = _INTO_GRAD.set(True)
    try:
        yield
    finally:
        _INTO_GRAD.reset(token)


def grad_target(weight: torch.Tensor) -> torch.Tensor | None:
    """The parameter whose .grad the head's backward may write itself: a plain leaf with no gradient hooks, in a
    single process (FSDP and DDP reduce gradients as autograd delivers them), inside weight_grad_into_param."""
    hooked = weight._backward_hooks or getattr(weight, "_post_accumulate_grad_hooks", None)
    if not _INTO_GRAD.get() or not weight.is_leaf or not weight.requires_grad or hooked:
        return None
    return None if dist.is_available() and dist.is_initialized() else weight


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
        return _forward(hidden, weight, targets, inv_t, rows, with_entropy)[:2]
    logp, entropy = _ChunkedLogprobs.apply(hidden, weight, targets, inv_t, rows, with_entropy, entropy_grad)
    return logp, entropy if with_entropy else None


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, inv_t: float, out: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """fp32 z = h @ W.T / T for one chunk (the matmul itself in the autocast dtype when autocast is on); into `out`
    (a reused buffer) where the product is fp32 already."""
    if out is not None and h.dtype == weight.dtype == torch.float32 and not torch.is_autocast_enabled(h.device.type):
        z = torch.mm(h, weight.t(), out=out)
    else:
        z = (h @ weight.t()).float()
    return z.mul_(inv_t) if inv_t != 1.0 else z


FORWARD_ROWS = 1024  # rows per pass over the vocabulary (each pass walks it in _block_cols blocks)


BLOCK_COLS = 1024  # vocabulary columns per block at least: a block of 1k rows' logits is 4 MiB, cache-sized
BLOCK_LOGITS = 256 * 1024  # logits per block at least: few rows get wider blocks, so per-block op costs stay small


def _block_cols(rows: int, vocab: int, width: int) -> int:
    """Vocabulary columns per block for `width` rows (forward and backward walk the same blocks): cache-sized, and
    never more logits than `rows` full rows hold (the chunk budget).

    Why cache-sized: the block's product and the exps, sums and gradients that follow it reread it, so a block
    that spills out of the cache slows the product and everything after it, and the head's forward and backward
    run closer to the matmul rate with cache-sized blocks (docs/benchmarks.md, "One-pass RMSNorm and SwiGLU,
    cache-sized head blocks")."""
    width = max(1, width)
    return max(1, min(vocab, rows * vocab // width, max(BLOCK_COLS, BLOCK_LOGITS // width)))


@torch.no_grad()
def _forward(hidden, weight, targets, inv_t, rows, with_entropy):
    """Per-row logsumexp, target logprob and entropy: (logp, entropy or None, logsumexp per row).

    Walks the vocabulary in blocks of columns for up to FORWARD_ROWS rows at once, carrying each row's running
    max, sum of exp and (for the entropy) sum of exp * (logit - max) across blocks, as the backward walks it. Why not
    chunks of `rows` full rows: a few hundred rows against the whole [hidden x 49k] head make a product too wide
    for the cache, slower than many rows against a block of columns (docs/benchmarks.md, "Where a fit paged"); and
    each chunk's fresh logits and exps (tens of MB) page-faulted where the trainer trims its heap, while here two
    buffers serve every block."""
    n = hidden.shape[0]
    logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
    lse_all = torch.empty(n, dtype=torch.float32, device=hidden.device)
    entropy = torch.empty(n, dtype=torch.float32, device=hidden.device) if with_entropy else None
    weight = _autocast_once(weight, hidden.device.type)
    span = max(rows, min(n, FORWARD_ROWS))
    width = min(n, span)  # rows in a pass
    cols = _block_cols(rows, weight.shape[0], width)
    # the block's logits, and with the entropy its exps beside them (without it they replace the logits)
    buf = torch.empty(2 if with_entropy else 1, width * cols, dtype=torch.float32, device=hidden.device) \
        if n else None
    for s in range(0, n, span):
        e = min(n, s + span)
        out = _rows_forward(hidden[s:e], weight, targets[s:e], inv_t, cols, with_entropy, buf)
        logp[s:e], lse_all[s:e] = out[0], out[1]
        if entropy is not None:
            entropy[s:e] = out[2]
    return logp, entropy, lse_all


def _rows_forward(h, weight, targets, inv_t, cols, with_entropy, buf):
    """One pass over the vocabulary for rows h: (logp, logsumexp, entropy or None), an online softmax."""
    r = h.shape[0]
    top = torch.full((r,), float("-inf"), dtype=torch.float32, device=h.device)
    total = torch.zeros(r, dtype=torch.float32, device=h.device)
    ez = torch.zeros(r, dtype=torch.float32, device=h.device) if with_entropy else None  # sum exp(y) y, y = z - top
    picked = torch.empty(r, dtype=torch.float32, device=h.device)
    for v0 in range(0, weight.shape[0], cols):
        block = weight[v0: v0 + cols]
        w = block.shape[0]
        z = _chunk_logits(h, block, inv_t, buf[0, : r * w].view(r, w))
        inside = ((targets >= v0) & (targets < v0 + w)).nonzero().squeeze(-1)
        picked[inside] = z[inside, targets[inside] - v0]
        new_top = torch.maximum(top, z.amax(-1))
        shift = top - new_top  # <= 0; -inf at the first block, where the sums are still 0
        rescale = shift.exp()
        y = z.sub_(new_top[:, None])  # logits less the running max: exp never overflows, sums cancel little
        if ez is None:
            total.mul_(rescale).add_(y.exp_().sum(-1))
        else:
            ex = torch.exp(y, out=buf[1, : r * w].view(r, w))
            block_total = ex.sum(-1)
            # sum exp(y) y re-based on the new max: each earlier term's y moves by `shift`
            ez.add_(shift.nan_to_num_(neginf=0.0).mul_(total)).mul_(rescale).add_(ex.mul_(y).sum(-1))
            total.mul_(rescale).add_(block_total)
        top = new_top
    log_total = total.log()
    lse = top + log_total
    return picked - lse, lse, None if ez is None else log_total - ez / total


def _autocast_once(weight: torch.Tensor, device: str) -> torch.Tensor:
    """The head's weight in the autocast dtype, cast once for all chunks: autocast would cast it again for each
    chunk's matmul (a [vocab x hidden] copy per chunk of rows, a noticeable share of a fit)."""
    if torch.is_autocast_enabled(device) and weight.dtype == torch.float32:
        return weight.to(torch.get_autocast_dtype(device))
    return weight


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_t, rows, with_entropy, entropy_grad):
        device = hidden.device.type  # backward runs outside the caller's autocast: it is restored from here
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        logp, entropy, lse = _forward(hidden, weight, targets, inv_t, rows, with_entropy)
        if entropy is None:
            entropy = logp.new_zeros(0)
        ctx.save_for_backward(hidden, weight, targets, entropy, lse)
        ctx.grad_target = grad_target(weight)
        # backward walks the vocabulary in the forward's blocks of columns (_block_cols) for all rows at once
        ctx.inv_t, ctx.cols, ctx.entropy_grad = inv_t, _block_cols(rows, weight.shape[0], hidden.shape[0]), \
            with_entropy and entropy_grad
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        device, enabled, dtype = ctx.autocast
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            return _backward(ctx, grad_logp, grad_entropy)


def _backward(ctx, grad_logp, grad_entropy):
    """Recompute the logits one block of vocabulary columns at a time, for all rows: each block's weight
    gradient is written once (row chunks would rewrite the whole [vocab x hidden] gradient per chunk, a cost that
    grows with the vocabulary and dominates the head at 152k); the rows' logsumexp saved by forward normalises it."""
    hidden, weight, targets, entropy, lse = ctx.saved_tensors
    ent = (entropy, grad_entropy) if ctx.entropy_grad and grad_entropy is not None else None
    grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) \
        if ctx.needs_input_grad[0] else None
    target = ctx.grad_target if ctx.needs_input_grad[1] else None
    if target is not None and target.grad is None:
        target.grad = torch.zeros_like(target)
    grad_weight = torch.empty(weight.shape, dtype=torch.float32, device=weight.device) \
        if ctx.needs_input_grad[1] and target is None else None
    autocast = torch.is_autocast_enabled(hidden.device.type)
    for v0 in range(0, weight.shape[0], ctx.cols):
        block = weight[v0: v0 + ctx.cols]
        dz = _block_grad_logits(hidden, block, v0, targets, lse, ctx.inv_t, grad_logp, ent)
        if not autocast:  # autocast casts the matmul operands itself
            dz = dz.to(weight.dtype)
        if grad_hidden is not None:
            grad_hidden += dz @ block
        if grad_weight is not None:
            grad_weight[v0: v0 + ctx.cols] = dz.t() @ hidden
        elif target is not None:
            target.grad[v0: v0 + ctx.cols].add_(dz.t() @ hidden)
        del dz  # else it lives on while the next block is computed: two blocks instead of one
    return (None if grad_hidden is None else grad_hidden.to(hidden.dtype),
            None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None, None, None)


def _block_grad_logits(hidden, block, v0, targets, lse, inv_t, grad_logp, ent):
    """d loss / d logits [rows, block] in fp32: g_lp * onehot - p * (g_lp [+ g_H * (lp + H)]), / T.

    Computed in place: one block-sized buffer without the entropy's gradient, two with it (the block's logits
    and their gradient are the head's whole working memory in backward)."""
    lp = _chunk_logits(hidden, block, inv_t).sub_(lse[:, None])
    g = grad_logp[:, None]
    if ent is None:
        dz = lp.exp_().mul_(g).neg_()
    else:
        entropy, g_ent = ent
        dz = lp.exp()
        dz.mul_(lp.add_(entropy[:, None]).mul_(g_ent[:, None]).add_(g)).neg_()
    inside = ((targets >= v0) & (targets < v0 + block.shape[0])).nonzero().squeeze(-1)
    dz[inside, targets[inside] - v0] += grad_logp[inside]
    return dz.mul_(inv_t) if inv_t != 1.0 else dz
