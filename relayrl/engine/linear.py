"""A CPU engine's float32 LM head through oneDNN, on machines where oneDNN is the faster library for it.

Why: PyTorch computes an fp32 `F.linear` on the CPU with MKL's sgemm. For an LM head at a decode step's shape (a few
dozen rows against a [vocab x hidden] matrix) MKL can run far below the machine's rate on some CPUs, where
oneDNN's matmul (`torch.ops.mkldnn._linear_pointwise`, the op PyTorch's own compiler emits for CPU linears) runs
the same product much faster (docs/benchmarks.md, "Rollout speed"), on the same plain weight tensor: no packed copy,
so no extra memory and nothing to redo when the weights change. The layers' own projections stay on MKL: there
neither library wins reliably. Which library wins depends on the CPU, so a quick
measurement at a head-like shape decides, once per machine (relayrl.common.hardware.measured), and checks the two
agree.

One difference to know: oneDNN's sums may group differently for the same weight at another address (after
release_memory gives the weights back and a sync reallocates them), so logits then agree to float rounding rather
than bit for bit (tests/integration/test_memory_release.py); seeded sampling stays seeded.

Only the engine's forwards take this path: the patched forward checks for inference mode, which LocalEngine's worker
runs in and training never does (the trainer's no-grad passes included), so a model shared by engine and trainer
still trains, and computes old/reference logprobs, through plain `F.linear`.
"""

from __future__ import annotations

import logging
import types

import torch
import torch.nn.functional as F

from relayrl.common.hardware import measured, seconds_per_call

log = logging.getLogger(__name__)

_SHAPES = ((64, 576, 16384), (8, 576, 16384))  # decode rows (a full batch, a tail) x hidden x an LM-head slice


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), weight, bias, "none", [], "")
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if torch.is_inference_mode_enabled() and x.dtype == torch.float32 and self.weight.dtype == torch.float32:
        return _onednn(x, self.weight, self.bias)
    return F.linear(x, self.weight, self.bias)


def _seconds(fn, budget: float = 0.05) -> float:
    return seconds_per_call(fn, budget, min_reps=3)


def _measure() -> dict:
    """Both libraries at decode-like shapes; oneDNN counts only where it gives F.linear's results."""
    mkl = onednn = 0.0
    agree = True
    with torch.inference_mode():
        for m, k, n in _SHAPES:
            x, w = torch.randn(m, k), torch.randn(n, k) / k**0.5
            agree &= torch.allclose(_onednn(x, w, None), F.linear(x, w), rtol=1e-4, atol=1e-4)
            mkl += _seconds(lambda: F.linear(x, w))  # noqa: B023 - called at once
            onednn += _seconds(lambda: _onednn(x, w, None))  # noqa: B023
    return {"default_s": mkl, "onednn_s": onednn, "agree": bool(agree)}


def onednn_is_faster() -> tuple[bool, str]:
    """Whether an fp32 LM head at decode shapes runs faster through oneDNN than through PyTorch's default on this
    machine (measured once, cached), and why, for the engine's start-up log."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False, "this PyTorch has no oneDNN linear"
    try:
        r = measured("onednn_lm_head", _measure)
    except RuntimeError as e:  # an op missing or refusing these tensors in this build
        return False, f"oneDNN linear failed: {e}"
    ratio = r["default_s"] / r["onednn_s"]
    faster = r["agree"] and ratio >= 1.1
    return faster, (f"oneDNN {ratio:.2f}x PyTorch's default at an LM head's decode shapes (measured, cached)"
                    if r["agree"]
                    else "oneDNN's results differ from F.linear's")


def install(model: torch.nn.Module) -> bool:
    """Send `model`'s LM head (its output embeddings, a plain nn.Linear on the CPU) through oneDNN in inference mode;
    False where the model has no such head."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear or head.weight.device.type != "cpu":
        return False
    head.forward = types.MethodType(_forward, head)
    return True


def choose(model: torch.nn.Module, setting: str) -> str:
    """An fp32 LM head on a CPU through oneDNN where it is faster here (or `setting` says so), else PyTorch's;
    returns "onednn" or "default" and logs why."""
    param = next(model.parameters())
    if setting == "default" or param.device.type != "cpu" or param.dtype != torch.float32:
        return "default"
    faster, why = (True, "asked for") if setting == "onednn" else onednn_is_faster()
    if faster and not install(model):
        faster, why = False, "the model's LM head is not a plain nn.Linear"
    log.info("LocalEngine fp32 LM head: %s (%s)", "oneDNN" if faster else "PyTorch's default", why)
    return "onednn" if faster else "default"
