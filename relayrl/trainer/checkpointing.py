"""Activation checkpointing that keeps the costly matmul outputs: what a checkpointed layer saves for backward.

Why: with plain checkpointing each layer saves only its input and its forward runs again during backward, which
costs a third more matmul work per trained token. Most of a layer's activations are cheap to recompute (norms,
rotary embeddings, the SiLU and the gating product); its matmul outputs are not. `model.checkpoint_saves` names what
the layers keep instead of recomputing (selective activation checkpointing, torch.utils.checkpoint's policy API):
- "nothing": plain checkpointing (least memory);
- "mlp": the outputs of the MLP's gate and up projections (the [tokens x intermediate] matmuls: half a Llama layer's
  forward matmul work, 2/3 of what plain checkpointing reruns, which stops before down_proj since backward needs
  only its input). The backward then reruns the attention projections only;
- "matmuls": every matmul output of the layer; the recompute is left with elementwise work and attention.
Each kept output costs its size per trained token and layer for the whole micro-batch (README job at SmolLM2-135M:
"mlp" keeps 2 x 1536 fp32 values per token and layer, 0.37 MB per token over 30 layers).
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

Saves = Literal["nothing", "mlp", "matmuls"]
_MATMULS = {torch.ops.aten.mm.default: 1, torch.ops.aten.addmm.default: 2, torch.ops.aten.bmm.default: 1}


def checkpoint_kwargs(model: torch.nn.Module, saves: Saves) -> dict:
    """Keyword arguments for torch.utils.checkpoint (via `activation_checkpointing_enable`) that keep `saves`."""
    kwargs: dict = {"use_reentrant": False}
    if saves == "nothing":
        return kwargs
    widths = None if saves == "matmuls" else frozenset({int(model.config.intermediate_size)})
    kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, functools.partial(_policy, widths))
    return kwargs


def _policy(widths: frozenset[int] | None, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Save a matmul's output when its width is one of `widths` (None: every matmul); recompute everything else."""
    arg = _MATMULS.get(op)
    if arg is not None and (widths is None or args[arg].shape[-1] in widths):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE
