"""The experts a mixture-of-experts model routed each token to, recorded by LocalEngine (rollout routing replay).

Why here, beside the KV cache: a token's routing belongs to the same (slot, position) as its keys and values, and the
engine already moves those around: batched prefills with padding, a shared start computed once and copied to
its group's slots, a running twin's prompt copied, a parked trajectory's prefix restored for its next turn, slots
compacted as sequences finish, KV rebuilt after a weight update. `RoutedSlotCache` keeps a routing table
[slots, MoE layers, length, k] beside the keys and values and moves it with them in every one of those operations,
so a finished sequence's table says which experts produced every position the engine ran, whichever path ran it.
The routers report their choice through forward hooks (relayrl.models.moe.Record), only for the forwards that
write this cache (not a trainer's forward of a shared model, not `score`).

What a GenOutput carries: `routed_experts` [prompt + output - 1, layers, k], the positions whose hidden states
the engine computed. The last output token was sampled but never run through the model; nothing trained depends on
its routing (its own logprob comes from the position before it). The prompt's routing is recorded too: a token's
logprob depends on the keys and values of every position before it, and those depend on those positions' experts.
Stored as uint8 (up to 256 experts a layer, int16 beyond): layers x k bytes per token (48 x 8 = 384 for
Qwen3-30B-A3B; 2 x 2 = 4 for the tiny test model).
"""

from __future__ import annotations

import numpy as np
import torch

from relayrl.engine.kv_cache import SlotKVCache
from relayrl.engine.sequence import Seq
from relayrl.models.moe import Record, expert_dtype, route_shape, routers

_TORCH = {np.dtype(np.uint8): torch.uint8, np.dtype(np.int16): torch.int16}


class RoutedSlotCache(SlotKVCache):
    """A SlotKVCache that also keeps each position's routed experts, filled by the model's routers."""

    def __init__(self, model: torch.nn.Module, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 slots: int = 8, length: int = 256, device: torch.device | str = "cpu"):
        self.moe_layers, self.top_k, experts = route_shape(model)
        self.route_dtype = _TORCH[expert_dtype(experts)]
        self.routes = torch.zeros(0, self.moe_layers, 0, self.top_k, dtype=self.route_dtype, device=device)
        super().__init__(num_layers, kv_heads, head_dim, dtype, slots, length, device)
        self._recording = False
        decoder = model.get_decoder()
        # a forward writes this cache when it is handed this cache: only those forwards are recorded
        decoder.register_forward_pre_hook(self._enter, with_kwargs=True)
        decoder.register_forward_hook(self._leave)
        self._record = Record(model, self._store, lambda: self._recording)

    def _enter(self, module, args, kwargs) -> None:
        self._recording = kwargs.get("cache") is self

    def _leave(self, module, args, out) -> None:
        self._recording = False

    # ---- the routers' side ---------------------------------------------------------------------
    def _store(self, layer: int, experts: torch.Tensor) -> None:
        """Write one MoE layer's choices for the current forward where its keys and values go."""
        table = self.routes[:, layer]  # [slots, length, k], a view
        experts = experts.to(self.route_dtype)
        if self._mode[0] == "prefill":
            index, start = self._mode[1], self._mode[2]
            rows = 1 if isinstance(index, int) else index.numel()
            width = experts.shape[0] // rows
            table[index, start: start + width] = experts.view(width, -1) if rows == 1 else experts.view(
                rows, width, -1)
        elif self._mode[0] == "decode":
            positions = self._mode[1]
            table[torch.arange(positions.numel(), device=positions.device), positions] = experts

    def routed(self, slot: int, length: int) -> np.ndarray:
        """The experts of a slot's first `length` positions: [length, layers, k], uint8 or int16."""
        return self.routes[slot, :, :length].transpose(0, 1).clone(memory_format=torch.contiguous_format).cpu().numpy()

    # ---- SlotKVCache's storage operations, on the routing table as well -------------------------
    def ensure(self, slots: int, length: int) -> None:
        super().ensure(slots, length)
        old = self.routes
        if old.shape[0] == self.slots and old.shape[2] == self.length:
            return
        self.routes = torch.zeros(self.slots, self.moe_layers, self.length, self.top_k, dtype=self.route_dtype,
                                  device=self.device)
        self.routes[: old.shape[0], :, : old.shape[2]] = old

    def release(self) -> int:
        freed = super().release() + self.routes.numel() * self.routes.element_size()
        self.routes = self.routes[:0, :, :0].clone()
        return freed

    def nbytes(self) -> int:
        return super().nbytes() + self.routes.numel() * self.routes.element_size()

    @property
    def bytes_per_token(self) -> int:
        return super().bytes_per_token + self.moe_layers * self.top_k * self.route_dtype.itemsize

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        super().copy_slot(src, dst, length)
        self.routes[dst, :, :length] = self.routes[src, :, :length]

    def export(self, slot: int, length: int) -> list[torch.Tensor]:
        """Keys and values of all layers, then the routing table's rows (parked prefixes, the shared start)."""
        return super().export(slot, length) + [self.routes[slot, :, :length].clone()]

    def restore(self, slot: int, saved: list[torch.Tensor]) -> None:
        super().restore(slot, saved[:-1])
        self.routes[slot, :, : saved[-1].shape[1]] = saved[-1]


def slot_cache(model: torch.nn.Module, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
               slots: int = 8, length: int = 256, device: torch.device | str = "cpu") -> SlotKVCache:
    """LocalEngine's KV cache for `model`: one that records routed experts when the model is MoE."""
    if not routers(model):
        return SlotKVCache(num_layers, kv_heads, head_dim, dtype, slots, length, device)
    return RoutedSlotCache(model, num_layers, kv_heads, head_dim, dtype, slots, length, device)


def keep_routes(cache: SlotKVCache, seq: Seq, slot: int) -> None:
    """Before a sequence leaves its slot: copy its routed experts onto it (its GenOutput carries them)."""
    seq.routed_experts = cache.routed(slot, seq.kv_len)
