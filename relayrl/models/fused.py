"""RMSNorm and SwiGLU in one pass each, forward and backward, for a model trained on the CPU in fp32.

Why: PyTorch runs a Llama-style RMSNorm and SwiGLU MLP as chains of elementwise ops, and their backwards as longer
ones, each a pass over [tokens x hidden] with an op dispatch; the activation's exp runs at accurate-libm cost. Beside
the matmuls, these chains are most of a CPU fit's elementwise time (docs/benchmarks.md, "One-pass RMSNorm and
SwiGLU, cache-sized head blocks").
`kernels/norm_swiglu.c` does each in one pass per row; `install` sends a model's RMSNorm modules and SiLU-gated MLPs
through it where the tensors are plain fp32 CPU tensors, and leaves everything else (bf16 under autocast, GPUs,
DTensor shards under FSDP, float64 in the exactness tests) to the modules' own forwards. Results equal PyTorch's to
float rounding (sums grouped differently; tests/unit/test_fused_layers.py). RELAYRL_KERNELS_OFF=norm_swiglu (or
RELAYRL_KERNELS=0) switches it off.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from relayrl.common import cbuild
from relayrl.common.device import plain_cpu

_SOURCE = Path(__file__).with_name("kernels") / "norm_swiglu.c"


@functools.cache
def load_kernel() -> ctypes.CDLL | None:
    """The compiled library, or None (logged once) when it cannot be built or kernels are switched off."""
    i64, ptr, f32, th = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    signatures = {"relayrl_rms_norm_fwd": ([i64, i64, ptr, ptr, f32, ptr, ptr, th], None),
                  "relayrl_rms_norm_bwd": ([i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, th], ctypes.c_int),
                  "relayrl_swiglu_fwd": ([i64, ptr, ptr, ptr, th], None),
                  "relayrl_swiglu_bwd": ([i64, ptr, ptr, ptr, ptr, ptr, th], None)}
    return cbuild.load(_SOURCE, signatures=signatures, fallback="RMSNorm and SwiGLU run as PyTorch ops")


def _plain_f32(*tensors: torch.Tensor) -> bool:
    """Plain fp32 CPU tensors: a DTensor shard, a device pointer or another dtype must never reach C."""
    return plain_cpu(*tensors) and all(t.dtype == torch.float32 for t in tensors)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        lib, d = load_kernel(), x.shape[-1]
        x, weight = x.contiguous(), weight.contiguous()  # C walks both as dense arrays
        y, r = torch.empty_like(x), torch.empty(x.numel() // d, dtype=torch.float32)
        lib.relayrl_rms_norm_fwd(r.numel(), d, x.data_ptr(), weight.data_ptr(), eps, y.data_ptr(), r.data_ptr(),
                                 torch.get_num_threads())
        ctx.save_for_backward(x, weight, r)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight, r = ctx.saved_tensors
        dy = dy.contiguous()
        dx, dw = torch.empty_like(x), torch.zeros_like(weight)
        if load_kernel().relayrl_rms_norm_bwd(r.numel(), x.shape[-1], dy.data_ptr(), x.data_ptr(), weight.data_ptr(),
                                              r.data_ptr(), dx.data_ptr(), dw.data_ptr(), torch.get_num_threads()):
            raise MemoryError("RMSNorm kernel: out of memory for its per-thread weight-gradient sums")
        return dx, dw if ctx.needs_input_grad[1] else None, None


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.contiguous(), up.contiguous()
        y = torch.empty_like(gate)
        load_kernel().relayrl_swiglu_fwd(y.numel(), gate.data_ptr(), up.data_ptr(), y.data_ptr(),
                                         torch.get_num_threads())
        ctx.save_for_backward(gate, up)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        gate, up = ctx.saved_tensors
        dy = dy.contiguous()
        dg, du = torch.empty_like(gate), torch.empty_like(up)
        load_kernel().relayrl_swiglu_bwd(dy.numel(), dy.data_ptr(), gate.data_ptr(), up.data_ptr(), dg.data_ptr(),
                                         du.data_ptr(), torch.get_num_threads())
        return dg, du


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2) + eps)) over the last dimension, in one pass (fp32 CPU tensors only)."""
    return _RMSNorm.apply(x, weight, eps)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in one pass (fp32 CPU tensors of the same shape only)."""
    return _SwiGLU.apply(gate, up)


def _norm_forward(module: torch.nn.Module, inner, x: torch.Tensor) -> torch.Tensor:
    if _plain_f32(x, module.weight) and module.weight.shape == x.shape[-1:]:
        return rms_norm(x, module.weight, float(module.variance_epsilon))
    return inner(x)


def _mlp_forward(module: torch.nn.Module, _inner, x: torch.Tensor) -> torch.Tensor:
    gate = module.gate_proj(x)
    up = module.up_proj(x)
    if _plain_f32(gate, up) and gate.shape == up.shape:
        return module.down_proj(swiglu(gate, up))
    return module.down_proj(module.act_fn(gate) * up)


def _is_rms_norm(m: torch.nn.Module) -> bool:
    """A Llama-style RMSNorm: weight * normalised x, no bias, no offset (Gemma's 1 + weight is another formula)."""
    return (type(m).__name__ in ("LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm", "Qwen3RMSNorm")
            and isinstance(getattr(m, "weight", None), torch.Tensor) and hasattr(m, "variance_epsilon"))


def _is_swiglu_mlp(m: torch.nn.Module) -> bool:
    return (type(m).__name__ in ("LlamaMLP", "Qwen2MLP", "MistralMLP", "Qwen3MLP")
            and all(hasattr(m, n) for n in ("gate_proj", "up_proj", "down_proj"))
            and type(getattr(m, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation"))  # torch's, transformers'


def install(model: torch.nn.Module) -> int:
    """Send `model`'s Llama-style RMSNorms and SiLU-gated MLPs through the one-pass kernels (for fp32 CPU inputs);
    returns how many modules. 0 when the kernel is off or did not build. Installing twice changes nothing."""
    if load_kernel() is None:
        return 0
    count = 0
    for m in model.modules():
        patch = _norm_forward if _is_rms_norm(m) else _mlp_forward if _is_swiglu_mlp(m) else None
        if patch is None:
            continue
        if not (isinstance(m.forward, functools.partial) and m.forward.func is patch):
            m.forward = functools.partial(patch, m, m.forward)
        count += 1
    return count
