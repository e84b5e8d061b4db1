"""Where models and their tensors live: the `run.device` setting and the device of a loaded model.

Why one small module: the engine, the trainer and the builder each need "the device of this model" and "the
device this run asked for"; with one definition, every tensor an engine or trainer creates follows its model,
so nothing is tied to the CPU except what must be (the C decode kernel, which LocalEngine uses only on CPU).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: the config schema validates settings without it
    import torch

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
