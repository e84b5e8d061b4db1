"""Where models and their tensors live: the `run.device` setting and the device of a loaded model.

Why one small module: the engine, the trainer and the builder each need "the device of this model" and "the
device this run asked for"; with one definition, every tensor an engine or trainer creates follows its model,
so nothing is tied to the CPU except what must be (the C decode kernel, which LocalEngine uses only on CPU).
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING

from relayrl.common.memory import mem_total_bytes

if TYPE_CHECKING:  # torch is imported where it is used: the config schema validates settings without it
    import torch

log = logging.getLogger(__name__)

DEVICE_SETTINGS = "auto, cpu, cuda or cuda:N"
_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")


def valid_device_setting(setting: str) -> bool:
    """Whether `setting` is a device relayrl accepts (checked when the config loads, before any model does)."""
    return isinstance(setting, str) and _PATTERN.fullmatch(setting) is not None


def resolve_device(setting: str | torch.device | None = "auto") -> torch.device:
    """"auto" (or None) -> cuda when a CUDA device is usable, else cpu; "cpu", "cuda", "cuda:N" as given.

    Asking for CUDA on a machine without it is an error here rather than a failure deep inside a forward.
    """
    import torch

    if isinstance(setting, torch.device):
        device = setting
    elif setting is None or setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    elif not valid_device_setting(setting):
        raise ValueError(f"device must be {DEVICE_SETTINGS}, got {setting!r}")
    else:
        device = torch.device(setting)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {setting!r}: CUDA is not available on this machine "
                           f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}); use auto or cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise RuntimeError(f"device {setting!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of a model's weights (the first parameter's; relayrl keeps a model on one device)."""
    return next(model.parameters()).device


def device_memory_bytes(device: torch.device) -> int | None:
    """The memory a model on `device` lives in: the GPU's own, or the machine's RAM (None where unknown)."""
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_properties(device).total_memory
    return mem_total_bytes()


def avoid_cudnn_attention(device: torch.device) -> None:
    """On CUDA, turn off scaled_dot_product_attention's cuDNN backend (flash, memory-efficient and math stay on).

    Why: cuDNN builds an execution plan per input shape, and relayrl's shapes change at every call: a decode step
    grows the context by one token, packed training changes the rows of every micro-batch, so the planning is
    paid at every attention call and a small model's decode step becomes bound by host time spent planning, not by
    the GPU (docs/benchmarks.md, "On a GPU", the first and second runs; bench/engine.py decode_profile). The switch is
    process-wide (torch has no per-thread one), set by the engine and the trainer when their model is on a GPU; a
    program that wants cuDNN back calls torch.backends.cuda.enable_cudnn_sdp(True).
    """
    import torch

    if device.type == "cuda" and torch.backends.cuda.cudnn_sdp_enabled():
        torch.backends.cuda.enable_cudnn_sdp(False)
        log.info("SDPA's cuDNN backend turned off: it re-plans per shape, and decode and packed training change "
                 "shape at every call (relayrl.common.device.avoid_cudnn_attention)")


def plain_cpu(*tensors: torch.Tensor) -> bool:
    """Plain CPU tensors (torch.Tensor or nn.Parameter, no subclass): the only ones whose data_ptr a C kernel may
    take. A DTensor shard's pointer is its local piece, a GPU tensor's a device address."""
    import torch

    return all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu" for t in tensors)
