"""A CPU engine's decode step written out for Llama-shaped decoders, instead of the Hugging Face module tree.

Why: a decode step's work is small (one token per running sequence), and on a CPU the HF forward's Python costs
show: per layer it builds rotary embeddings, masks and cache calls, reshapes and transposes queries, keys and values,
and dispatches through a dozen module calls. Written out (the same weights and kernels: the engine's linears, the
decode-attention kernel through the slot cache), a SmolLM2-135M step at 16 rows went from 49.8 to 47.1 ms and at 32
rows from 87.2 to 83.0 ms on a Zen 4 as AVX2 (docs/benchmarks.md, "Rollout speed"), with the same logits bit for bit.

Only where the HF forward is known to compute the same thing: Llama, Qwen2 and Mistral configs with SiLU MLPs, no
sliding window and rotary embeddings whose frequencies are fixed (default, linear, llama3), and only in the fused
decode path (the C attention kernel). The engine also checks it once against the HF forward on a real decode step
and keeps the HF forward where they differ.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from relayrl.engine.kv_cache import SlotKVCache

_TYPES = ("llama", "qwen2", "mistral")
_STATIC_ROPE = (None, "default", "linear", "llama3")


def why_not(model: torch.nn.Module) -> str | None:
    """Why `model`'s decode step cannot be written out here (None: it can)."""
    cfg = model.config
    if cfg.model_type not in _TYPES:
        return f"model type {cfg.model_type!r} (written out for {', '.join(_TYPES)})"
    rope = getattr(cfg, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type")) not in _STATIC_ROPE:
        return f"rotary scaling {rope!r} changes with the length"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r}"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return "a sliding window"
    core = getattr(model, "model", None)
    layers = getattr(core, "layers", None)
    if layers is None or not hasattr(core, "rotary_emb") or not hasattr(model, "lm_head"):
        return "the model does not have the layout model.layers / model.rotary_emb / lm_head"
    linears = ("q_proj", "k_proj", "v_proj", "o_proj")
    for layer in layers:
        if not all(type(getattr(layer.self_attn, n, None)) is torch.nn.Linear for n in linears) or not all(
                type(getattr(layer.mlp, n, None)) is torch.nn.Linear for n in ("gate_proj", "up_proj", "down_proj")):
            return "a layer's projections are not plain nn.Linear"
    return None


def _norm(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """RMSNorm: torch's fused op in fp32 (the same values as HF's formula, fewer passes), the module's own else."""
    if x.dtype == torch.float32 and module.weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), module.weight, module.variance_epsilon)
    return module(x)


def decode_logits(model: torch.nn.Module, cache: SlotKVCache, tokens: torch.Tensor,
                  positions: torch.Tensor) -> torch.Tensor:
    """Logits [n, vocab] of one decode step: token tokens[i] at positions[i] of slot i, attention through the cache's
    kernel (cache.decode(...) must have been called for this step)."""
    cfg, core = model.config, model.model
    n = tokens.shape[0]
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    rot = core.rotary_emb
    freqs = positions[:, None].to(torch.float32) * rot.inv_freq[None].float()
    dtype = core.embed_tokens.weight.dtype
    cos = (freqs.cos() * rot.attention_scaling).to(dtype)[:, None]  # [n, 1, dim / 2], each half of a head
    sin = (freqs.sin() * rot.attention_scaling).to(dtype)[:, None]
    half = dim // 2

    def rope(t: torch.Tensor) -> torch.Tensor:  # HF's rotate_half form on [n, heads, dim]
        t1, t2 = t[..., :half], t[..., half:]
        return torch.cat((t1 * cos - t2 * sin, t2 * cos + t1 * sin), -1)

    h = core.embed_tokens(tokens)
    for i, layer in enumerate(core.layers):
        a, mlp = layer.self_attn, layer.mlp
        x = _norm(layer.input_layernorm, h)
        q = rope(a.q_proj(x).view(n, heads, dim))
        k = rope(a.k_proj(x).view(n, kv_heads, dim))
        v = a.v_proj(x).view(n, kv_heads, dim)
        out = cache.attend(i, q[:, :, None], k[:, :, None], v[:, :, None], a.scaling)
        h = h + a.o_proj(out.view(n, heads * dim))
        x = _norm(layer.post_attention_layernorm, h)
        h = h + mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    return model.lm_head(_norm(core.norm, h))
