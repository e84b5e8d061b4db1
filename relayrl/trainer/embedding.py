"""The input embedding's backward, written straight into `weight.grad` row by row.

Why: autograd's embedding backward builds a dense [vocab x hidden] gradient for every micro-batch (zeroed, then the
batch's few hundred rows added) and then adds all of it into `weight.grad`. At SmolLM2-135M that is 113 MB zeroed and
113 MB added per micro-batch, for at most a micro-batch's token count of rows that are not zero. On a CPU the zeroing
is the costly part: where the trainer trims its heap between passes (with checkpointing) the block is fresh memory
each time, so every page faults, at every micro-batch (docs/benchmarks.md, "Where a fit paged: the head's chunks,
the embedding's gradient, the trims"). Here the backward adds the rows the batch used into `weight.grad` (allocated once
per optimizer step) and hands autograd nothing for the weight.

It applies under relayrl.trainer.logprobs.weight_grad_into_param, to the same weights its LM head writes into (a
plain leaf, no gradient hooks, a single process): code that calls `torch.autograd.grad` or runs under FSDP/DDP gets
autograd's own path.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from relayrl.trainer.logprobs import grad_target


class _EmbeddingIntoGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.weight, ctx.padding_idx = weight, padding_idx
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        flat, rows = ids.reshape(-1), grad_out.reshape(-1, grad_out.shape[-1])
        if ctx.padding_idx is not None:  # as nn.Embedding: the padding row gets no gradient
            keep = flat != ctx.padding_idx
            flat, rows = flat[keep], rows[keep]
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        weight.grad.index_add_(0, flat, rows.to(weight.grad.dtype))
        return None, None, None


def _forward(module: torch.nn.Embedding, inner, ids: torch.Tensor) -> torch.Tensor:
    """The patched forward: the row-wise backward where grad_target allows it, the module's own otherwise."""
    if torch.is_grad_enabled() and grad_target(module.weight) is not None:
        return _EmbeddingIntoGrad.apply(ids, module.weight, module.padding_idx)
    return inner(ids)


def install(model: torch.nn.Module) -> bool:
    """Give `model`'s input embedding the row-wise backward; False (untouched) unless it is a plain nn.Embedding
    (no max_norm, gradient scaling by frequency or sparse gradients, which have their own backward)."""
    emb = model.get_input_embeddings()
    if type(emb) is not torch.nn.Embedding or emb.max_norm is not None or emb.scale_grad_by_freq or emb.sparse:
        return False
    if not isinstance(emb.forward, functools.partial):  # once, whatever the callers
        emb.forward = functools.partial(_forward, emb, emb.forward)
    return True
