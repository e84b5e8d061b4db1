"""A CPU engine's fp32 linears at decode steps of up to 64 rows through a C kernel built for few rows.

Why: a decode step runs its linears on as many rows as sequences are running (64 at a GRPO batch's start, a handful
in its tail), and the weights (SmolLM2-135M: 430 MB of fp32 layer weights) do not fit in any cache. PyTorch's fp32
`F.linear` (MKL sgemm, oneDNN alike) can read them well below the machine's memory bandwidth at so few rows, so a
step with a handful of rows costs about as much as a full one, and mid-sized row counts run below the library's own
rate on large products (docs/benchmarks.md, "Rollout speed"). `kernels/skinny_linear.c` streams each weight row once
at 1-4 rows and multiplies register tiles (12 accumulators) at 5-64 rows, so the weights are read once per step at
memory speed (bench/kernels.py skinny_rows). As the rows approach 64 a GEMM library catches up and the kernel's margin
becomes small and unsteady, which is why the limit is measured rather than fixed.

Where it pays depends on the CPU, so a quick measurement on weights larger than the last-level cache decides up to
how many rows the kernel is used, once per machine and kernel source (relayrl.common.hardware.measured); 0 turns it
off. Like relayrl.engine.linear's oneDNN head, only the engine's forwards take this path (inference mode, fp32, CPU):
the trainer's forwards of a shared model stay plain F.linear. Sums are grouped differently from MKL's, so logits agree
to float rounding (~1e-5), not bit for bit. RELAYRL_KERNELS_OFF=skinny_linear (or RELAYRL_KERNELS=0) switches it off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from relayrl.common import cbuild
from relayrl.common.device import plain_cpu
from relayrl.common.hardware import measured, seconds_per_call

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("kernels") / "skinny_linear.c"
MAX_ROWS = 64  # the kernel's limit
_CANDIDATES = (64, 48, 32, 24, 16, 8)  # row limits tried, largest first


_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
SIGNATURES = {"relayrl_skinny_linear_f32": ([_I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, ctypes.c_int], ctypes.c_int),
              "relayrl_skinny_multi_f32": ([_I64, _I64, _PTR, _I64, ctypes.c_int, _PTR, _PTR, _PTR, ctypes.c_int],
                                           ctypes.c_int)}
MAX_WEIGHTS = 4  # weights per skinny_multi call (the kernel's MAX_MATS)


@functools.cache
def load_kernel() -> ctypes.CDLL | None:
    return cbuild.load(_SOURCE, signatures=SIGNATURES,
                       fallback="the engine's linears use PyTorch's at every batch size")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, k] with unit stride along k (the kernel reads rows at any stride, values contiguous)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def skinny_linear(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., k] @ weight[n, k]^T (+ bias) with at most MAX_ROWS rows of x, fp32 CPU tensors."""
    x2 = _rows(x)
    if not weight.is_contiguous() or x2.device.type != "cpu" or weight.device.type != "cpu":
        raise RuntimeError("skinny_linear takes contiguous CPU tensors")  # a device pointer in C would crash
    m, n = x2.shape[0], weight.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if lib.relayrl_skinny_linear_f32(m, n, x2.shape[1], x2.data_ptr(), x2.stride(0), weight.data_ptr(), y.data_ptr(),
                                     torch.get_num_threads()):
        raise RuntimeError(f"skinny_linear refused {m} rows (at most {MAX_ROWS})")
    if bias is not None:
        y += bias
    return y.reshape(*x.shape[:-1], n)


def skinny_multi(lib: ctypes.CDLL, x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """[x2 @ w^T for w in weights] (x2: x as [rows, k], at most MAX_ROWS rows) in one kernel call: a decode layer's
    q, k and v, or its gate and up, share one parallel region. Each result equals `skinny_linear`'s bit for bit."""
    x2 = _rows(x)
    m, k = x2.shape
    if (not 0 < len(weights) <= MAX_WEIGHTS or not plain_cpu(x2, *weights)
            or any(not w.is_contiguous() or w.shape[1] != k or w.dtype != torch.float32 for w in weights)):
        raise RuntimeError("skinny_multi takes up to 4 contiguous fp32 CPU weights of the input's width")
    ys = [torch.empty(m, w.shape[0], dtype=torch.float32) for w in weights]
    count = len(weights)
    w_ptrs = (ctypes.c_void_p * count)(*[w.data_ptr() for w in weights])
    y_ptrs = (ctypes.c_void_p * count)(*[y.data_ptr() for y in ys])
    sizes = (ctypes.c_int64 * count)(*[w.shape[0] for w in weights])
    if lib.relayrl_skinny_multi_f32(m, k, x2.data_ptr(), x2.stride(0), count, w_ptrs, y_ptrs, sizes,
                                    torch.get_num_threads()):
        raise RuntimeError(f"skinny_multi refused {m} rows (1 to {MAX_ROWS})")
    return ys


def _forward(module: torch.nn.Linear, inner, rows: int, x: torch.Tensor) -> torch.Tensor:
    """The patched forward. It holds no library handle (looked up, cached): a model is deep-copied (a reference
    policy, a critic) and ctypes handles cannot be."""
    w = module.weight
    if (torch.is_inference_mode_enabled() and x.dtype == torch.float32 and w.dtype == torch.float32
            and 0 < x.numel() <= rows * x.shape[-1] and w.is_contiguous()):
        return skinny_linear(load_kernel(), x, w, module.bias)
    return inner(x)


def install(model: torch.nn.Module, rows: int) -> int:
    """Send `model`'s fp32 CPU nn.Linear layers through the kernel for inputs of at most `rows` rows (in inference
    mode); their own forward (the LM head's oneDNN one included) for the rest. Returns how many layers."""
    lib = load_kernel()
    if lib is None or rows <= 0:
        return 0
    patched = 0
    for mod in model.modules():
        if type(mod) is torch.nn.Linear and mod.weight.device.type == "cpu" and mod.weight.dtype == torch.float32:
            mod.forward = functools.partial(_forward, mod, mod.forward, min(rows, MAX_ROWS))
            patched += 1
    return patched


def _measure() -> dict:
    """Seconds of 16 distinct [1536 x 576] weights (56 MB: more than a last-level cache) at each candidate row count,
    PyTorch's F.linear against the kernel, and whether they agree."""
    lib = load_kernel()
    weights = [torch.randn(1536, 576) / 24 for _ in range(16)]
    out: dict = {"agree": True}
    with torch.inference_mode():
        for m in _CANDIDATES:
            x = torch.randn(m, 576)
            out["agree"] &= bool(torch.allclose(skinny_linear(lib, x, weights[0], None), F.linear(x, weights[0]),
                                                rtol=1e-4, atol=1e-4))
            out[f"default_s_{m}"] = seconds_per_call(lambda: [F.linear(x, w) for w in weights], 0.04, 3)  # noqa: B023
            out[f"kernel_s_{m}"] = seconds_per_call(lambda: [skinny_linear(lib, x, w, None)  # noqa: B023
                                                             for w in weights], 0.04, 3)
    return out


@functools.cache
def _source_hash() -> str:
    return hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:12]


def measured_rows() -> tuple[int, str]:
    """Up to how many rows the kernel beats PyTorch's default here by >= 1.1x (measured once, cached), and why."""
    if load_kernel() is None:
        return 0, "the kernel did not build or is switched off"
    r = measured(f"skinny_linear:{_source_hash()}", _measure)  # a new kernel is measured anew
    if not r["agree"]:
        return 0, "the kernel's results differ from F.linear's"
    rows = next((m for m in _CANDIDATES if r[f"default_s_{m}"] / r[f"kernel_s_{m}"] >= 1.1), 0)
    ratios = ", ".join(f"{m} rows {r[f'default_s_{m}'] / r[f'kernel_s_{m}']:.2f}x" for m in reversed(_CANDIDATES))
    return rows, f"measured against PyTorch's default on streamed weights (cached): {ratios}"


def choose(model: torch.nn.Module, rows: int | None) -> int:
    """Install the kernel for up to `rows` rows (None: as measured here) on a CPU fp32 engine model; returns the row
    limit in use (0: off) and logs why."""
    param = next(model.parameters())
    if param.device.type != "cpu" or param.dtype != torch.float32 or rows == 0:
        return 0
    rows, why = (rows, "set") if rows is not None else measured_rows()
    if rows and not install(model, rows):
        rows, why = 0, "the kernel did not build or is switched off"
    log.info("LocalEngine fp32 linears at <= %d rows: %s (%s)", rows, "C kernel" if rows else "PyTorch's", why)
    return rows
