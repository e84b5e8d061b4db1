"""The weights a `LocalEngine` generates with: written in place by policy updates, given back to a colocated trainer.

Kept apart from the engine's batching because the rules are their own: tensors are matched by name (tied aliases
such as lm_head.weight included), LoRA adapters are merged into a copy of their layers' base weights rather than
written, fp32 weights arriving at a bf16 engine are rounded stochastically (rounded to nearest, updates smaller than
half a bf16 step would never reach it: relayrl.trainer.optim.round_to_bf16_), and weights released while the
trainer needs the memory must all come back with the next update. The engine holds its step lock around `write`;
`stage` runs beside generation, before the pause.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

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
        for name, tensor, dst, seed in self._targets(named_tensors, version, adapters):
            if dst is None:
                raise KeyError(f"engine model has no parameter {name!r}")
            if dst.data_ptr() != tensor.data_ptr():  # an engine sharing the trainer's weights has them already
                self._copy(dst, tensor, seed)
            written.add(id(dst))
            self._lora_base.pop(name, None)
        if missing := [n for n, t in self._params.items() if id(t) in released and id(t) not in written]:
            raise ValueError(f"the engine's weights were released and this update lacks {missing[:3]} "
                             f"({len(missing)} tensors): send every weight after release_memory(weights=True)")
        merge_into(self._state, adapters, self._lora_base)

    def _targets(self, named: Iterable[tuple[str, torch.Tensor]], version: int,
                 adapters: dict) -> Iterator[tuple[str, torch.Tensor, torch.Tensor | None, int]]:
        """(name, tensor, the engine's weight of that name or None, rounding seed) for each tensor that is not a
        LoRA adapter (those go into `adapters`). The seed counts distinct weights in order, so that `stage` rounds
        exactly as `write` would."""
        seen: set[int] = set()
        for name, tensor in named:
            if is_adapter_name(name):
                adapters[name] = tensor
                continue
            dst = self._state.get(name)
            yield name, tensor, dst, (version * 1_000_003 + len(seen)) * 7919 + self.seed
            if dst is not None:
                seen.add(id(dst))

    @torch.no_grad()
    def stage(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
              version: int) -> list[tuple[str, torch.Tensor]]:
        """The update with every tensor that needs moving to the engine's device or rounding into its dtype
        already moved and rounded (on a side CUDA stream on a GPU), the others as they are: `write` then only
        copies within the device, so the engine pauses for a copy instead of the move and the rounding. Why: a
        GPU producer fed host fp32 copies by the dist transport did both with its engine paused; staged, the
        write is a small part of a load, whose remaining time is mostly waiting for the engine to stop
        (LocalEngine._between_steps; the seventh GPU run in docs/history.md). Costs one copy of
        the staged weights, in the engine's dtype, until the write; on a GPU without that much free memory (and
        256 MiB to spare) nothing is staged. Bit for bit what `write` alone would write: the same rounding seeds."""
        named = list(named_tensors)
        todo = [(i, dst, seed) for i, (name, t, dst, seed) in enumerate(self._targets(named, version, {}))
                if dst is not None and (t.device != dst.device or t.dtype != dst.dtype)]
        if not todo:
            return named
        device = todo[0][1].device
        cuda = device.type == "cuda"
        if cuda and not _fits_on_gpu(device, [(named[i][1], dst) for i, dst, _ in todo]):
            return named
        caller, stream = (torch.cuda.current_stream(device), torch.cuda.Stream(device)) if cuda else (None, None)
        if cuda:  # GPU sources (a colocated trainer's weights) may still be written by the caller's queued kernels
            stream.wait_stream(caller)
        with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
            for i, dst, seed in todo:  # `named` is this call's own list: staged tensors replace their sources
                name, t = named[i]
                out = torch.empty(t.shape, dtype=dst.dtype, device=dst.device)
                self._copy(out, t, seed)
                if cuda:  # read by the caller's stream in `write`: not reused before that copy is done
                    out.record_stream(caller)
                named[i] = (name, out)
        if cuda:
            stream.synchronize()
        return named

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


def _fits_on_gpu(device: torch.device, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Whether staging `pairs` (source, engine weight) fits in the GPU's free memory with 256 MiB to spare: the
    staged copies in the weights' dtype, plus one source tensor at a time moved over for its rounding."""
    staged = sum(t.numel() * dst.element_size() for t, dst in pairs)
    moved = max((t.numel() * t.element_size() for t, dst in pairs if t.device != dst.device), default=0)
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return staged + moved + (256 << 20) <= free + cached


def stored_in_float32(path: str | Path) -> bool:
    """Whether a model folder's safetensors hold fp32 floating weights (a model relayrl trained: its trainer's fp32
    weights). Read from the files' headers, not config.json, whose dtype field is optional."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        return False
    with safe_open(str(files[0]), "pt") as f:
        return any(f.get_slice(k).get_dtype() == "F32" for k in f.keys())  # noqa: SIM118 (a file, not a dict)
