"""LoRA training (peft) with adapter-only weight relay (model.lora_rank > 0).

The trainer wraps the policy with peft: only the low-rank adapters train, so the optimizer holds only them,
and the KL reference is the same model with its adapters switched off (no second copy of the weights).
After each step only the adapters travel to the inference engines, which stay plain HF models:

    wire format, per adapted linear layer M (its name in the plain HF model, peft's prefix stripped):
    M.lora_A [r, in], M.lora_B [out, r], M.lora_scaling [1] (alpha / r)

HF parameter names end in `.weight` / `.bias`, so a receiver tells adapters from full weights by name alone,
and every transport (in process, disk, dist) carries them unchanged. An engine merges
W = W_base + scaling * B @ A in fp32 over its own copy of the base weights, so each update replaces the
previous adapters instead of stacking on them. Export merges with the same formula. A `relayrl serve` receives the
same tensors (by path or broadcast) and checks them against its model first (`adapter_shape_error`,
`adapter_set_error`); a vLLM server gets them as a PEFT adapter folder (`peft_adapter`), which it applies unmerged.
Under FSDP the adapters are sharded like every parameter and gathered whole for the sync and the export.

peft is imported only when LoRA is used: a run without it does not pay for the import.
"""

from __future__ import annotations

import itertools
import json
import re
import sys
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from relayrl.config import ConfigError
from relayrl.models.loading import load_model
from relayrl.models.store import atomic_build

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
    """The wire tensors of a peft model (see the module docstring), in `targeted` order. Adapters sharded by FSDP
    (DTensors) are gathered whole, one at a time: a collective, so every rank iterates, in this same order."""
    from peft.tuners.lora import LoraLayer

    layers = {name.removeprefix(_PEFT_PREFIX): m for name, m in model.named_modules()
              if isinstance(m, LoraLayer) and ADAPTER in m.lora_A}
    for name in sorted(layers):
        m = layers[name]
        yield f"{name}.lora_A", _whole(m.lora_A[ADAPTER].weight)
        yield f"{name}.lora_B", _whole(m.lora_B[ADAPTER].weight)
        yield f"{name}.lora_scaling", torch.tensor([float(m.scaling[ADAPTER])])


def _whole(p: torch.Tensor) -> torch.Tensor:
    dtensor = sys.modules.get("torch.distributed.tensor")  # not imported (a heavy import): nothing is sharded
    return (p.full_tensor() if dtensor is not None and isinstance(p, dtensor.DTensor) else p).detach()


def adapter_template(model: torch.nn.Module, cfg) -> list[tuple[str, torch.Tensor]]:
    """Empty tensors named and shaped like `adapter_tensors` of `model` wrapped with `cfg`, from the plain
    model alone: a dist receiver needs them to know what the sender will broadcast."""
    out = []
    for name in targeted(model, cfg.lora_target_modules):
        w = model.get_submodule(name).weight
        out += [(f"{name}.lora_A", torch.empty(cfg.lora_rank, w.shape[1])),
                (f"{name}.lora_B", torch.empty(w.shape[0], cfg.lora_rank)), (f"{name}.lora_scaling", torch.empty(1))]
    return out


def merged_state_dict(model: torch.nn.Module,
                      adapters: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The plain HF state dict of a peft model with its adapters merged in (for export: no peft needed to load
    it). Adapted weights are new tensors; the others are the model's own. `adapters`: the wire tensors already
    gathered from a sharded model (train.engine=fsdp), whose base weights are shards spread over the ranks: its
    base is read again from the model's folder instead, which it equals (the base is frozen)."""
    if adapters is None:
        base = {k.replace(".base_layer.", "."): v for k, v in model.get_base_model().state_dict().items()
                if not _PEFT_ONLY.search(k)}
        adapters = dict(adapter_tensors(model))
    else:
        plain = model.get_base_model()
        dtype = next(p.dtype for p in plain.parameters() if not p.requires_grad)
        base = load_model(plain.name_or_path, dtype=dtype).state_dict()
    for key, (a, b, scaling) in _by_weight(adapters).items():
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


def adapter_shape_error(name: str, shape: tuple[int, ...], served: dict[str, torch.Tensor]) -> str | None:
    """Why wire tensor `name` of `shape` is no adapter of the served model (None: it is one). The wire format
    carries rank and scaling, so a receiver (relayrl serve) needs no LoRA config: the rank is read from A and B,
    from 1 to min(out, in) (a higher rank adapts nothing more, and would let a client make the server allocate
    more than the layer itself)."""
    layer, _, part = name.rpartition(".")
    w = served.get(f"{layer}.weight")
    if w is None or w.dim() != 2:
        return f"the served model has no linear layer {layer!r} to adapt"
    out, inp = w.shape
    rank = (shape[0] if part == "lora_A" else shape[-1]) if shape else 0
    expected = {"lora_A": (rank, inp), "lora_B": (out, rank), "lora_scaling": (1,)}[part]
    if tuple(shape) != expected:
        return f"shape {list(shape)}, expected {list(expected)} for an adapter of {layer}.weight {[out, inp]}"
    if part != "lora_scaling" and not 1 <= rank <= min(out, inp):
        return f"rank {rank} is outside 1..{min(out, inp)} for {layer}.weight {[out, inp]}"
    return None


def adapter_set_error(shapes: dict[str, tuple[int, ...]]) -> str | None:
    """Why the adapters among an update's {name: shape} are not whole: every layer needs its three parts, and
    A and B one rank (merge_into would fail half-way through the update otherwise)."""
    for layer in sorted({n.rpartition(".")[0] for n in shapes if is_adapter_name(n)}):
        missing = [p for p in ADAPTER_PARTS if f"{layer}.{p}" not in shapes]
        if missing:
            return f"the adapter of {layer!r} has no {', '.join(missing)}"
        a, b = shapes[f"{layer}.lora_A"], shapes[f"{layer}.lora_B"]
        if a[:1] != b[-1:]:  # (the shapes' lengths are checked per tensor, where the shapes are known)
            return f"{layer}: lora_A has rank {list(a[:1])}, lora_B {list(b[-1:])}"
    return None


def peft_adapter(adapters: Iterable[tuple[str, torch.Tensor]]) -> tuple[dict, dict[str, torch.Tensor]]:
    """Wire tensors as a PEFT adapter folder: (adapter_config.json, adapter_model.safetensors) contents, the
    format vLLM's /v1/load_lora_adapter and peft's PeftModel.from_pretrained read. PEFT's config holds one
    rank and one alpha (= scaling * rank) for all layers, as a run trains (model.lora_rank, model.lora_alpha)."""
    layers = _by_weight(dict(adapters))
    ranks = {a.shape[0] for a, _, _ in layers.values()}
    scalings = {float(s) for _, _, s in layers.values()}
    if len(ranks) != 1 or len(scalings) != 1:
        raise ValueError(f"a PEFT adapter has one rank and one scaling; these adapters have ranks {sorted(ranks)} "
                         f"and scalings {sorted(scalings)}")
    (rank,), (scaling,) = ranks, scalings
    tensors, modules = {}, []
    for key, (a, b, _) in layers.items():
        module = key.removesuffix(".weight")
        modules.append(module)
        tensors[f"{_PEFT_PREFIX}{module}.lora_A.weight"] = a.detach().to("cpu").contiguous()
        tensors[f"{_PEFT_PREFIX}{module}.lora_B.weight"] = b.detach().to("cpu").contiguous()
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": scaling * rank,
              "target_modules": modules, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
              "use_rslora": False, "use_dora": False, "modules_to_save": None, "inference_mode": True}
    return config, tensors


def peek_adapters(named: Iterable[tuple[str, torch.Tensor]]
                   ) -> tuple[Iterable[tuple[str, torch.Tensor]], bool]:
    """(the same tensors, whether they are LoRA adapters), telling by the first name without consuming a lazy
    source: a LoRA trainer sends adapters only (relayrl.trainer.engine.TrainEngine.named_parameters)."""
    it = iter(named)
    first = next(it, None)
    if first is None:
        return (), False
    return itertools.chain([first], it), is_adapter_name(first[0])


def save_peft_version(root: Path, adapters: Iterable[tuple[str, torch.Tensor]], version: int) -> Path:
    """Write ROOT/v{version} as a PEFT adapter folder (adapter_config.json, adapter_model.safetensors), atomically."""
    config, tensors = peft_adapter(adapters)

    def build(tmp: Path) -> None:
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=1))
        save_file(tensors, str(tmp / "adapter_model.safetensors"))

    return atomic_build(Path(root) / f"v{version}", build, force=True)


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
