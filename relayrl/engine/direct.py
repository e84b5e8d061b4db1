"""A CPU engine's decode step written out for Llama-shaped decoders, instead of the Hugging Face module tree.

Why: a decode step's work is small (one token per running sequence), and on a CPU the HF forward's Python costs
show: per layer it builds rotary embeddings, masks and cache calls, reshapes and transposes queries, keys and values,
and dispatches through a dozen module calls. Written out (the same weights and kernels: the engine's linears, the
decode-attention kernel through the slot cache), a step saves that Python time (docs/benchmarks.md, "Rollout
speed"), its logits the same bit for bit with PyTorch's ops between the linears.

Between the linears, fp32 steps run C instead of PyTorch's ops (kernels/decode_ops.c: the residual add with the
RMSNorm after it, the rotary embedding of queries and keys in place; relayrl.models.fused's SwiGLU), and a layer's
q/k/v and gate/up projections are one few-row kernel call each (relayrl.engine.skinny.skinny_multi), which
saves the small ops' dispatch and one read of each layer's input per projection (bench/engine.py engine_step_parts,
docs/benchmarks.md, "Rollout speed"). Logits then agree with the HF
forward to float rounding (~1e-5), not bit for bit. RELAYRL_KERNELS_OFF=decode_ops keeps PyTorch's ops.

Only where the HF forward is known to compute the same thing: Llama, Qwen2 and Mistral configs with SiLU MLPs, no
sliding window and rotary embeddings whose frequencies are fixed (default, linear, llama3), and only in the fused
decode path (the C attention kernel). The engine also checks it once against the HF forward on a real decode step
and keeps the HF forward where they differ.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from relayrl.common import cbuild
from relayrl.common.device import plain_cpu
from relayrl.engine import skinny
from relayrl.engine.kv_cache import SlotKVCache
from relayrl.models import fused

_SOURCE = Path(__file__).with_name("kernels") / "decode_ops.c"

_TYPES = ("llama", "qwen2", "mistral")
_STATIC_ROPE = (None, "default", "linear", "llama3")


def why_not(model: torch.nn.Module) -> str | None:
    """Why `model`'s decode step cannot be written out here (None: it can)."""
    cfg = model.config
    if cfg.model_type not in _TYPES:
        return f"model type {cfg.model_type!r} (written out for {', '.join(_TYPES)})"
    rope = cfg.rope_parameters or {}  # transformers 5 folds a config.json's legacy rope_scaling into it
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


@functools.cache
def load_kernel() -> ctypes.CDLL | None:
    """kernels/decode_ops.c (the residual add + RMSNorm, the rotary embedding), or None when it cannot be built or is
    switched off (RELAYRL_KERNELS_OFF=decode_ops): then the step runs those as PyTorch ops."""
    i64, ptr, th = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    signatures = {"relayrl_add_rms_norm": ([i64, i64, ptr, ptr, ptr, ctypes.c_float, ptr, th], None),
                  "relayrl_rope_qk": ([i64, i64, i64, i64, ptr, i64, ptr, i64, ptr, ptr, th], None)}
    return cbuild.load(_SOURCE, signatures=signatures,
                       fallback="the decode step's norms and rotary embeddings run as PyTorch ops")


def _rotary(rot: torch.nn.Module, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [n, head_dim / 2] of each row's position (each half of a head uses the same ones)."""
    freqs = positions[:, None].to(torch.float32) * rot.inv_freq[None].float()
    return (freqs.cos() * rot.attention_scaling).to(dtype), (freqs.sin() * rot.attention_scaling).to(dtype)


def decode_logits(model: torch.nn.Module, cache: SlotKVCache, tokens: torch.Tensor,
                  positions: torch.Tensor, skinny_rows: int = 0) -> torch.Tensor:
    """Logits [n, vocab] of one decode step: token tokens[i] at positions[i] of slot i, attention through the cache's
    kernel (cache.decode(...) must have been called for this step). `skinny_rows`: up to how many rows the engine's
    linears run through the few-row kernel (relayrl.engine.skinny); then a layer's q/k/v and gate/up are one call."""
    ops, swiglu = load_kernel(), fused.load_kernel()
    core = model.model
    if ops is None or swiglu is None or core.embed_tokens.weight.dtype != torch.float32:
        return _decode_logits_torch(model, cache, tokens, positions)
    cfg, n = model.config, tokens.shape[0]
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    cos, sin = _rotary(core.rotary_emb, positions, torch.float32)
    lib = skinny.load_kernel() if n <= min(skinny_rows, skinny.MAX_ROWS) else None
    threads = torch.get_num_threads()

    def add_norm(h: torch.Tensor, delta: torch.Tensor | None, norm: torch.nn.Module, out: torch.Tensor) -> None:
        ops.relayrl_add_rms_norm(n, h.shape[1], h.data_ptr(), None if delta is None else delta.data_ptr(),
                                 norm.weight.data_ptr(), norm.variance_epsilon, out.data_ptr(), threads)

    h = core.embed_tokens(tokens).contiguous()  # the residual stream, updated in place
    x = torch.empty_like(h)
    layers = core.layers
    _check_plain(h, core.norm.weight, *(m.weight for layer in layers
                                         for m in (layer.input_layernorm, layer.post_attention_layernorm)))
    add_norm(h, None, layers[0].input_layernorm, x)
    for i, layer in enumerate(layers):
        a, mlp = layer.self_attn, layer.mlp
        q, k, v = _project(lib, x, (a.q_proj, a.k_proj, a.v_proj))
        ops.relayrl_rope_qk(n, heads, kv_heads, dim, q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0),
                            cos.data_ptr(), sin.data_ptr(), threads)
        out = cache.attend(i, q.view(n, heads, 1, dim), k.view(n, kv_heads, 1, dim), v.view(n, kv_heads, 1, dim),
                           a.scaling)
        add_norm(h, a.o_proj(out.view(n, heads * dim)).contiguous(), layer.post_attention_layernorm, x)
        gate, up = _project(lib, x, (mlp.gate_proj, mlp.up_proj))
        act = torch.empty_like(gate)
        swiglu.relayrl_swiglu_fwd(gate.numel(), gate.data_ptr(), up.data_ptr(), act.data_ptr(), threads)
        after = layers[i + 1].input_layernorm if i + 1 < len(layers) else core.norm
        add_norm(h, mlp.down_proj(act).contiguous(), after, x)
    return model.lm_head(x)


def _check_plain(*tensors: torch.Tensor) -> None:
    """C reads these through raw pointers: only plain, dense fp32 CPU tensors may reach it."""
    if not plain_cpu(*tensors) or any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors):
        raise RuntimeError("the written-out decode step takes dense fp32 CPU tensors only")


def _project(lib: ctypes.CDLL | None, x: torch.Tensor, linears: tuple[torch.nn.Linear, ...]) -> list[torch.Tensor]:
    """x through several linears that share it: one few-row kernel call (`lib`), else each module's own forward;
    outputs contiguous [n, out] either way."""
    if lib is None:
        return [m(x).contiguous() for m in linears]
    ys = skinny.skinny_multi(lib, x, [m.weight for m in linears])
    for y, m in zip(ys, linears):
        if m.bias is not None:
            y += m.bias
    return ys


def _decode_logits_torch(model: torch.nn.Module, cache: SlotKVCache, tokens: torch.Tensor,
                         positions: torch.Tensor) -> torch.Tensor:
    """decode_logits with PyTorch's ops between the linears (any dtype; no decode_ops kernel)."""
    cfg, core = model.config, model.model
    n = tokens.shape[0]
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    dtype = core.embed_tokens.weight.dtype
    cos, sin = (t[:, None] for t in _rotary(core.rotary_emb, positions, dtype))  # [n, 1, dim / 2]
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
