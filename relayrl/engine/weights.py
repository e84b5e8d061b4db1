"""The weights a `LocalEngine` generates with: written in place by policy updates, given back to a colocated trainer.

Kept apart from the engine's batching because the rules are their own: tensors are matched by name (tied aliases
such as lm_head.weight included), LoRA adapters are merged into a copy of their layers' base weights rather than
written, fp32 weights arriving at a bf16 engine are rounded stochastically (rounded to nearest, updates smaller than
half a bf16 step would never reach it: relayrl.trainer.optim.round_to_bf16_), and weights released while the
trainer needs the memory must all come back with the next update. The engine holds its step lock around every call.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from relayrl.trainer.lora import is_adapter_name, merge_into
from relayrl.trainer.optim import round_to_bf16_


class EngineWeights:
    def __init__(self, model: torch.nn.Module, *, seed: int, rounding: str, owned: bool):
        if rounding not in ("stochastic", "nearest"):
            raise ValueError(f"weight_rounding must be 'stochastic' or 'nearest', got {rounding!r}")
        self._params = dict(model.named_parameters())
        self._state = model.state_dict(keep_vars=True)  # also holds tied aliases (lm_head.weight)
        self._lora_base: dict[str, torch.Tensor] = {}  # adapted weights before their first LoRA merge
        self._released: dict[int, tuple] = {}  # id -> (parameter, shape) of weights emptied by release
        # False when the model is the trainer's own (colocated sync RL in the trainer's dtype): never released
        self.owned = owned
        self.seed, self.rounding = seed, rounding

    @torch.no_grad()
    def write(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy each tensor into the weight of that name (adapters: merge); reallocate released weights first and
        fail if the update leaves one of them unwritten."""
        adapters, written = {}, set()
        released, self._released = self._released, {}
        for p, shape in released.values():
            p.data = torch.empty(shape, dtype=p.dtype, device=p.device)
        for name, tensor in named_tensors:
            if is_adapter_name(name):
                adapters[name] = tensor
                continue
            if name not in self._state:
                raise KeyError(f"engine model has no parameter {name!r}")
            dst = self._state[name]
            if dst.data_ptr() != tensor.data_ptr():  # an engine sharing the trainer's weights has them already
                self._copy(dst, tensor, (version * 1_000_003 + len(written)) * 7919 + self.seed)
            written.add(id(dst))
            self._lora_base.pop(name, None)
        if missing := [n for n, t in self._params.items() if id(t) in released and id(t) not in written]:
            raise ValueError(f"the engine's weights were released and this update lacks {missing[:3]} "
                             f"({len(missing)} tensors): send every weight after release_memory(weights=True)")
        merge_into(self._state, adapters, self._lora_base)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, seed: int) -> None:
        """dst <- src; fp32 into bf16 rounds stochastically unless rounding="nearest". The seed is a function of
        (engine seed, version, tensor), so a resumed run rounds as the first did. Host copies for a GPU engine (the
        dist and disk transports) are rounded on the GPU: round_to_bf16_ rounds where `dst` lives."""
        if self.rounding == "stochastic" and dst.dtype == torch.bfloat16 and src.dtype == torch.float32:
            round_to_bf16_(dst, src.detach(), seed)
        else:
            dst.copy_(src)

    def release(self) -> int:
        """Empty every weight's storage (not the trainer's own); returns the bytes given back."""
        if not self.owned:
            return 0
        freed = 0
        for p in self._params.values():
            if id(p) not in self._released:
                self._released[id(p)] = (p, p.shape)
                freed += p.numel() * p.element_size()
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        return freed
