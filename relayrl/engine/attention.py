"""Decode-step attention for LocalEngine: a small C kernel over the slot KV cache, with SDPA as the fallback.

Why a kernel: at a rollout's shape (hundreds of sequences, one new token each, grouped-query heads) PyTorch's
CPU SDPA spends most of its time on per-(sequence, head) overhead and reads the cache at a fraction of the
machine's memory bandwidth, and attention is then the largest part of a decode step (docs/benchmarks.md, "Rollout
speed"). `kernels/decode_attention.c` reads every key
and value row once, for all query heads that share it, and also writes the step's new key/value (no separate
index_put). It is compiled once per machine (relayrl.common.cbuild) and loaded with ctypes, which releases the
GIL during the call. Without a compiler, or with RELAYRL_KERNELS=0, LocalEngine uses SDPA.
The kernel reads and writes CPU memory through raw pointers, so it is for CPU tensors only: an engine whose model
is on a GPU always uses SDPA (LocalEngine logs why), and `decode_attention` refuses anything else rather than
hand a device pointer to C.

The model reaches the kernel through relayrl's attention entry point (relayrl.models.attention.install), which calls
`SlotKVCache.attend` when a forward carries `relayrl_cache` in fused decode mode and leaves every other use of the
same model (the trainer's forward, prefill) to SDPA or the trainer's shared-prompt attention.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from relayrl.common import cbuild
from relayrl.common.device import model_device
from relayrl.models.attention import install as install  # LocalEngine routes the model's attention here

_SOURCE = Path(__file__).with_name("kernels") / "decode_attention.c"
# (model dtype, cache dtype) -> the kernel's name suffix: a cache in the model's dtype, or an fp32 model's bf16 cache
_VARIANTS = {(torch.bfloat16, torch.bfloat16): "bf16", (torch.float32, torch.float32): "f32",
             (torch.float32, torch.bfloat16): "f32_bf16kv"}
_MAX_G, _MAX_D = 16, 256  # the kernel's stack buffers (kernels/decode_attention.c)


def build(source: Path = _SOURCE, fallback: str = "LocalEngine uses PyTorch SDPA") -> ctypes.CDLL | None:
    """`source` (this kernel, or another version of its file: bench/kernels.py decode_attention) built by
    relayrl.common.cbuild and loaded with every variant's signature; None (logged with `fallback`) when it cannot be
    built or is off."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    args = [i64, i64, i64, i64, ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, i64, ptr, ctypes.c_float,
            ptr, ctypes.c_int]
    signatures = {f"relayrl_decode_attention_{name}": (args, ctypes.c_int) for name in _VARIANTS.values()}
    return cbuild.load(source, signatures=signatures, fallback=fallback)


@functools.cache
def load_kernel() -> ctypes.CDLL | None:
    """The compiled kernel library, or None (logged once) when it cannot be built or is switched off."""
    return build()


def kernel_supports(dtype: torch.dtype, num_heads: int, kv_heads: int, head_dim: int,
                    kv_dtype: torch.dtype | None = None) -> bool:
    """Whether the kernel takes a model in `dtype` over a cache in `kv_dtype` (None: the model's) of this shape."""
    return ((dtype, kv_dtype or dtype) in _VARIANTS and num_heads % kv_heads == 0
            and num_heads // kv_heads <= _MAX_G and head_dim <= _MAX_D)


def why_not_kernel(model: torch.nn.Module, kv_dtype: torch.dtype, heads: int, kv_heads: int,
                   head_dim: int) -> str | None:
    """Why `model` cannot attend through the kernel in decode steps over a cache in `kv_dtype` (None: it can, and
    its attention calls now come to relayrl's entry point)."""
    device = model_device(model)
    dtype = next(model.parameters()).dtype
    if device.type != "cpu":
        return f"the C kernel reads CPU memory and the model is on {device}"
    if not kernel_supports(dtype, heads, kv_heads, head_dim, kv_dtype):
        return f"no kernel for dtype={dtype}, kv_dtype={kv_dtype}, heads={heads}/{kv_heads}, head_dim={head_dim}"
    if load_kernel() is None:
        return "the kernel did not build (see the warning above) or RELAYRL_KERNELS=0"
    if not install(model):
        return f"the model's attention ({model.config._attn_implementation}) is not SDPA"
    return None


def decode_attention(lib: ctypes.CDLL, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Write key/value [n, kvh, 1, D] at `positions` of slots 0..n-1 of the caches [slots, kvh, M, D], then
    attend query [n, H, 1, D] over positions 0..positions[i]; returns [n, 1, H, D] (HF's layout after attention)."""
    n, heads, _, dim = query.shape
    kvh = key.shape[1]
    if query.device.type != "cpu" or k_cache.device.type != "cpu":  # a device pointer in C would crash the process
        raise RuntimeError(f"the decode-attention kernel runs on CPU tensors only, got {query.device}")
    assert query.stride(-1) == key.stride(-1) == value.stride(-1) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and positions.dtype == torch.int64
    variant = _VARIANTS.get((query.dtype, k_cache.dtype))
    if variant is None or key.dtype != query.dtype or value.dtype != query.dtype or v_cache.dtype != k_cache.dtype:
        raise RuntimeError(f"no decode-attention kernel for a {query.dtype} model over a {k_cache.dtype} cache")
    out = torch.empty(n, 1, heads, dim, dtype=query.dtype)
    fn = getattr(lib, f"relayrl_decode_attention_{variant}")
    rc = fn(n, kvh, heads // kvh, dim, query.data_ptr(), query.stride(0), query.stride(1),
            key.data_ptr(), key.stride(0), key.stride(1), value.data_ptr(), value.stride(0), value.stride(1),
            k_cache.data_ptr(), v_cache.data_ptr(),
            k_cache.stride(0), k_cache.stride(1), positions.data_ptr(), scale, out.data_ptr(),
            torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"decode-attention kernel refused heads={heads} kv_heads={kvh} head_dim={dim}")
    return out
