"""Mixture-of-experts routers: find them, record the experts they pick, and replay recorded experts.

Why: an MoE layer's router picks each token's top-k experts, and that choice is discontinuous. An inference
engine in another dtype, with other kernels or other batching, or a policy one update older, picks different
experts for some tokens than the trainer's forward does, and then the policy-gradient ratio is taken between two
different networks. Rollout routing replay (R3, Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by
Aligning Training and Inference Routers") records the experts the engine used for every token and has the trainer
use those.

How the trainer replays, following R3: the recorded experts replace the trainer router's own top-k, and the gating
weights are the trainer router's softmax probabilities at those experts (renormalised over them where the model
renormalises its top-k, as Qwen3-MoE and Mixtral do). So the router's weight still gets gradients through the
gating weights, and where the recorded experts equal the trainer's own choice the replay is the identity. (The
other published variant, replaying the engine's gating weights too, would cut the router off from the gradient.)

The routers relayrl knows are transformers' top-k router modules, which return (logits, top-k weights, top-k
indices) from hidden states flattened to [tokens, hidden]; a forward hook observes or replaces that triple, so
neither the model's code nor its fast paths change.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

# transformers' router classes relayrl knows (by name: importing four modeling modules to compare classes would cost
# every importer of this module seconds) -> whether it renormalises its top-k weights to sum to 1 (Mixtral always)
_RENORMALISES: dict[str, Callable[[nn.Module], bool]] = {
    "Qwen3MoeTopKRouter": lambda r: bool(r.norm_topk_prob), "Qwen2MoeTopKRouter": lambda r: bool(r.norm_topk_prob),
    "OlmoeTopKRouter": lambda r: bool(r.norm_topk_prob), "MixtralTopKRouter": lambda r: True}

NO_ROUTE = -1  # a replay entry that says "no record: let the router choose" (padding, tokens the engine never ran)


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's MoE routers in layer order (empty for a dense model)."""
    return [m for m in model.modules() if type(m).__name__ in _RENORMALISES]


def is_moe(model: nn.Module) -> bool:
    return bool(routers(model))


def route_shape(model: nn.Module) -> tuple[int, int, int]:
    """(MoE layers, experts per token, experts per layer) of an MoE model."""
    found = routers(model)
    if not found:
        raise ValueError("not a mixture-of-experts model: no router relayrl knows")
    return len(found), int(found[0].top_k), int(found[0].num_experts)


def expert_dtype(num_experts: int) -> np.dtype:
    """The smallest integer type for expert ids: uint8 up to 256 experts per layer, else int16."""
    return np.dtype(np.uint8) if num_experts <= 256 else np.dtype(np.int16)


def gate_weights(router: nn.Module, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """The router's own gating weights for `experts` [tokens, k]: its softmax over all experts taken at those,
    renormalised over them where the router renormalises (as its forward computes them for its own top-k)."""
    probs = torch.softmax(logits.float(), dim=-1).gather(-1, experts)
    if _RENORMALISES[type(router).__name__](router):
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs.to(logits.dtype)


class Replay:
    """Replay recorded experts in the forwards run inside it (a context manager).

    `routed` [tokens, layers, k] (int, NO_ROUTE where the router chooses itself), in the order the routers see
    tokens: the forward's [rows, width] positions flattened row-major. While the context is open every router
    forward uses those experts (R3, module docstring) and counts how many (token, layer) choices of its own equal the
    recorded ones (`agreed` of `compared`: the same set, in any order). `routed=None` replays nothing and counts
    nothing. Only the forwards inside the context are affected: an engine sharing the model keeps its own routing.
    """

    def __init__(self, model: nn.Module, routed: torch.Tensor | None):
        self.routers = routers(model) if routed is not None else []
        if routed is not None and routed.shape[1] != len(self.routers):
            raise ValueError(f"routed experts cover {routed.shape[1]} MoE layers, the model has {len(self.routers)}")
        self.routed = routed
        self.agreed = self.compared = 0
        self._handles: list = []

    def __enter__(self) -> Replay:
        self._handles = [r.register_forward_hook(self._hook(layer)) for layer, r in enumerate(self.routers)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook(self, layer: int):
        def hook(router: nn.Module, args, out):
            logits, _, own = out
            want = self.routed[:, layer].to(own.device, torch.long)
            if want.shape != own.shape:
                raise ValueError(f"replay of {tuple(want.shape)} routes for a forward of {tuple(own.shape)}")
            recorded = want[:, 0] >= 0
            with torch.no_grad():
                same = (want.sort(-1).values == own.sort(-1).values).all(-1) & recorded
                self.agreed += int(same.sum())
                self.compared += int(recorded.sum())
            experts = torch.where(recorded[:, None], want, own)
            return logits, gate_weights(router, logits, experts), experts
        return hook


class Record:
    """Call `sink(layer, experts)` with each router's chosen experts [tokens, k] while installed (engine side).

    `active()` says whether the current forward is one to record (the engine records its own cache forwards, not a
    trainer's forward of a shared model). Installed for the model's life: `remove()` takes it out."""

    def __init__(self, model: nn.Module, sink: Callable[[int, torch.Tensor], None], active: Callable[[], bool]):
        self._handles = [r.register_forward_hook(self._hook(layer, sink, active))
                         for layer, r in enumerate(routers(model))]

    @staticmethod
    def _hook(layer: int, sink: Callable[[int, torch.Tensor], None], active: Callable[[], bool]):
        def hook(router: nn.Module, args, out):
            if active():
                sink(layer, out[2])
        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


_EXPERT = re.compile(r"^(?P<block>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def model_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A saved folder's tensors under the names an MoE model holds them: transformers writes each expert's
    gate/up/down projections separately (the hub's layout, Qwen2/3-MoE and Mixtral alike) and loads them fused into
    `experts.gate_up_proj` [experts, 2 x intermediate, hidden] (gate first) and `experts.down_proj`, so code that
    reads safetensors itself (an engine loading new weights from disk) must fuse them too. Other names pass."""
    out, parts = {}, {}
    for name, t in tensors.items():
        m = _EXPERT.match(name)
        if m is None:
            out[name] = t
        else:
            parts.setdefault(m["block"], {}).setdefault(m["proj"], {})[int(m["e"])] = t
    for block, proj in parts.items():
        n = len(proj["down_proj"])
        out[f"{block}.gate_up_proj"] = torch.stack([torch.cat([proj["gate_proj"][e], proj["up_proj"][e]])
                                                    for e in range(n)])
        out[f"{block}.down_proj"] = torch.stack([proj["down_proj"][e] for e in range(n)])
    return out
