"""LoRA training (peft) with adapter-only weight relay (model.lora_rank > 0).

The trainer wraps the policy with peft: only the low-rank adapters train, so the optimizer holds only them,
and the KL reference is the same model with its adapters switched off (no second copy of the weights).
After each step only the adapters travel to the inference engines, which stay plain HF models:

    wire format, per adapted linear layer M (its name in the plain HF model, peft's prefix stripped):
    M.lora_A [r, in], M.lora_B [out, r], M.lora_scaling [1] (alpha / r)

HF parameter names end in `.weight` / `.bias`, so a receiver tells adapters from full weights by name alone,
and every transport (in process, disk, dist) carries them unchanged. An engine merges
W = W_base + scaling * B @ A in fp32 over its own copy of the base weights, so each update replaces the
previous adapters instead of stacking on them. Export merges with the same formula.

peft is imported only when LoRA is used: a run without it does not pay for the import.
"""

from __future__ import annotations

import re
import sys
import warnings
from collections.abc import Iterator

import torch

from relayrl.config import ConfigError

ADAPTER_PARTS = ("lora_A", "lora_B", "lora_scaling")
ADAPTER = "default"  # peft's name for the one adapter a run trains
_PEFT_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the HF model
_PEFT_ONLY = re.compile(r"\.lora_\w+\.")  # adapter entries of the wrapped model's state dict


def is_adapter_name(name: str) -> bool:
    return name.rpartition(".")[2] in ADAPTER_PARTS


def is_lora(model: torch.nn.Module) -> bool:
    """Whether `model` is peft-wrapped (peft not imported yet means it cannot be)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


# ---- which layers ------------------------------------------------------------------------------------
def linear_names(model: torch.nn.Module) -> list[str]:
    """Linear layers LoRA may adapt: all but the LM head, which many models tie to the input embeddings (a
    merge into it would change those too, unlike the trainer's adapter)."""
    head = model.get_output_embeddings()
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head]


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)  # peft's rule for a list of names


def targeted(model: torch.nn.Module, targets: list[str]) -> list[str]:
    """The layers adapted for `targets`, sorted: the sender's and a dist receiver's order of the wire tensors."""
    return sorted(n for n in linear_names(model) if any(_matches(n, t) for t in targets))


def check_targets(model: torch.nn.Module, targets: list[str]) -> None:
    """Every target must name a linear layer: a typo would otherwise train fewer layers than asked, silently."""
    names = linear_names(model)
    for t in targets:
        if not any(_matches(n, t) for n in names):
            short = sorted({n.rpartition(".")[2] for n in names})
            raise ConfigError(f"{t!r} matches no linear layer of the model (the LM head is never adapted); its "
                              f"linear layers are: {', '.join(short)}", key="model.lora_target_modules")


# ---- trainer side ------------------------------------------------------------------------------------
def wrap(model: torch.nn.Module, cfg) -> torch.nn.Module:
    """The policy as a peft model with fresh adapters (B = 0: it starts exactly at the base model).
    `cfg` holds the lora_* keys (relayrl.config.schema.ModelConfig)."""
    from peft import LoraConfig, get_peft_model

    check_targets(model, cfg.lora_target_modules)
    config = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                        target_modules=targeted(model, cfg.lora_target_modules), bias="none")
    with warnings.catch_warnings():  # peft (0.21 and before) reads the property transformers 5.23 renamed: not ours
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        return get_peft_model(model, config)


def adapter_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The wire tensors of a peft model (see the module docstring), in `targeted` order."""
    from peft.tuners.lora import LoraLayer

    layers = {name.removeprefix(_PEFT_PREFIX): m for name, m in model.named_modules()
              if isinstance(m, LoraLayer) and ADAPTER in m.lora_A}
    for name in sorted(layers):
        m = layers[name]
        yield f"{name}.lora_A", m.lora_A[ADAPTER].weight.detach()
        yield f"{name}.lora_B", m.lora_B[ADAPTER].weight.detach()
        yield f"{name}.lora_scaling", torch.tensor([float(m.scaling[ADAPTER])])


def adapter_template(model: torch.nn.Module, cfg) -> list[tuple[str, torch.Tensor]]:
    """Empty tensors named and shaped like `adapter_tensors` of `model` wrapped with `cfg`, from the plain
    model alone: a dist receiver needs them to know what the sender will broadcast."""
    out = []
    for name in targeted(model, cfg.lora_target_modules):
        w = model.get_submodule(name).weight
        out += [(f"{name}.lora_A", torch.empty(cfg.lora_rank, w.shape[1])),
                (f"{name}.lora_B", torch.empty(w.shape[0], cfg.lora_rank)), (f"{name}.lora_scaling", torch.empty(1))]
    return out


def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The plain HF state dict of a peft model with its adapters merged in (for export: no peft needed to load
    it). Adapted weights are new tensors; the others are the model's own."""
    base = {k.replace(".base_layer.", "."): v for k, v in model.get_base_model().state_dict().items()
            if not _PEFT_ONLY.search(k)}
    for key, (a, b, scaling) in _by_weight(dict(adapter_tensors(model))).items():
        base[key] = merge_weight(base[key], a, b, scaling).to(base[key].dtype)
    return base


class BaseReference:
    """The KL reference of a LoRA policy: the policy's own model with its adapters switched off, which is
    exactly the base model, so no second copy of the weights is loaded. Used where a reference TrainEngine is."""

    def __init__(self, engine):
        self.engine = engine

    def forward_logprobs(self, mb) -> torch.Tensor:
        with self.engine.model.disable_adapter():
            return self.engine.forward_logprobs(mb)

    def forward_logprobs_all(self, mbs: list) -> list[torch.Tensor]:
        return [self.forward_logprobs(mb) for mb in mbs]


# ---- engine side -------------------------------------------------------------------------------------
def merge_weight(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: torch.Tensor) -> torch.Tensor:
    """W + scaling * B @ A in fp32 (a bf16 product would round every update differently from the trainer), on W's
    device: adapters may arrive from a trainer on another device, or from disk on the CPU."""
    return w.float() + float(scaling) * (b.to(w.device, torch.float32) @ a.to(w.device, torch.float32))


def _by_weight(adapters: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, ...]]:
    """{'M.weight': (A, B, scaling)} from wire tensors; a layer missing a part is an error, not a skip."""
    out = {}
    for layer in sorted({n.rpartition(".")[0] for n in adapters}):
        missing = [p for p in ADAPTER_PARTS if f"{layer}.{p}" not in adapters]
        if missing:
            raise KeyError(f"adapter of {layer!r} is incomplete: no {', '.join(missing)}")
        out[f"{layer}.weight"] = tuple(adapters[f"{layer}.{p}"] for p in ADAPTER_PARTS)
    return out


@torch.no_grad()
def merge_into(params: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor],
               base: dict[str, torch.Tensor]) -> None:
    """Set each adapted weight of `params` in place to W_base + scaling * B @ A. `base` keeps the weight each
    layer had before its first adapters (filled here), so every update starts from the base again."""
    for key, (a, b, scaling) in _by_weight(adapters).items():
        if key not in params:
            raise KeyError(f"engine model has no parameter {key!r} (for its LoRA adapter)")
        w = params[key]
        if key not in base:
            base[key] = w.detach().clone()
        w.copy_(merge_weight(base[key], a, b, scaling))
