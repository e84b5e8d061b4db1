"""relayrl's attention entry point for Hugging Face models.

A model switched to the "relayrl" implementation (`install`) runs PyTorch SDPA, as before, unless a call carries
one of two keyword arguments, which transformers passes from the model's forward down to every attention call:
- `relayrl_cache`: the local engine's slot KV cache in fused decode mode; its C kernel attends
  (relayrl.engine.attention);
- `relayrl_segments`: the `SegmentLayout` of a training micro-batch whose rows share one prompt between several
  responses (relayrl.models.segments, built by relayrl.trainer.packer).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from relayrl.models.segments import segment_attention

NAME = "relayrl"


def attention(module, query, key, value, attention_mask, scaling=None, relayrl_cache=None, relayrl_segments=None,
              **kwargs):
    """transformers attention function: segments, the decode kernel, or SDPA (module doc)."""
    if relayrl_segments is not None and not any(kwargs.get(k) for k in ("sliding_window", "softcap", "dropout")):
        return segment_attention(query, key, value, relayrl_segments, scaling), None
    if relayrl_cache is not None and relayrl_cache.fused:
        if kwargs.get("sliding_window") or kwargs.get("softcap"):
            raise RuntimeError("relayrl's decode kernel has no sliding window or softcap")
        return relayrl_cache.attend(module.layer_idx, query, key, value, scaling or query.shape[-1] ** -0.5), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


def segments_pay_off(device: torch.device) -> bool:
    """Whether a trainer on `device` should send shared-prompt rows through relayrl.models.segments (else SDPA with
    the rows' dense mask). On a CPU they do: the C kernel skips the masked scores, which shortens the fit
    (docs/benchmarks.md, "The shared-prompt attention in C"). On a GPU they do not: the segments' PyTorch version
    (gathers, masked matmuls, a hand-written backward) is slower there than SDPA's fused kernels computing every
    score with the dense mask (bench/train.py train_step --device cuda; docs/benchmarks.md, "On a GPU")."""
    return device.type == "cpu"


def install(model: torch.nn.Module) -> bool:
    """Route `model`'s attention through `attention`; False (model untouched) unless it runs SDPA."""
    if getattr(model.config, "_attn_implementation", None) not in ("sdpa", NAME):
        return False
    AttentionInterface.register(NAME, attention)
    model.set_attn_implementation(NAME)
    return model.config._attn_implementation == NAME
