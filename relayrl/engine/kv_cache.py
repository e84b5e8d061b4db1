"""A slot KV cache for continuous batching with Hugging Face decoder models.

Each running sequence owns one slot: a row of preallocated key/value tensors per layer. Active
sequences always occupy slots 0..n-1 (a finished sequence's slot is refilled by moving the last one
into it), so a decode step reads `k[:n, :, :length]` as a view, with no per-step gather or
reallocation. Sequences of different lengths share the batch; a boolean attention mask hides each
slot's unused positions.

The object is passed to the model as `cache`; HF attention layers call `update()` with
the new keys/values of the current forward and attend over what it returns. In a *fused* decode step
(relayrl.engine.attention's C kernel) `update()` hands the new keys/values back untouched and the
attention function calls `attend()`, which writes them into the slots and attends in one pass.
The slots live on the model's device (LocalEngine passes it); only the fused CPU kernel path is CPU-bound.

The cache is a rectangle (slots x length): `bytes_for` says what a shape costs, so that an engine with a byte
budget (engine.kv_cache_gb) admits only the sequences whose grown rectangle still fits and queues the rest.

Its dtype may be narrower than the model's (engine.kv_dtype: an fp32 model over a bf16 cache, half the bytes per
token): keys and values are rounded as they are stored, and widened back wherever the model reads them (the C
kernel widens each row as it reads it; the SDPA paths get a widened copy of what they attend over).
"""

from __future__ import annotations

import numpy as np
import torch

from relayrl.engine.attention import decode_attention


class SlotKVCache:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 slots: int = 8, length: int = 256, device: torch.device | str = "cpu"):
        self.kernel = None  # the decode-attention library (relayrl.engine.attention.load_kernel), set by the engine
        self.fused = False  # the current decode step runs attention through the kernel
        self.attended = 0  # layers the kernel served in the current fused step (checked by the engine)
        self.num_layers, self.kv_heads, self.head_dim, self.dtype = num_layers, kv_heads, head_dim, dtype
        self.device = torch.device(device)  # the model's: keys and values never leave it
        self.slots, self.length = 0, 0
        self.generation = 0  # bumped whenever the tensors are reallocated (CUDA graphs hold their addresses)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.ensure(slots, length)
        self._mode: tuple = ("idle",)

    # ---- capacity ----------------------------------------------------------------------------
    def ensure(self, slots: int, length: int) -> None:
        """Grow (never shrink) to at least `slots` x `length`; existing contents are kept."""
        if slots <= self.slots and length <= self.length:
            return
        new_slots, new_len = max(slots, self.slots), max(length, self.length)
        shape = (new_slots, self.kv_heads, new_len, self.head_dim)
        new_k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        new_v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        for old, new in zip(self.k + self.v, new_k + new_v):
            new[: self.slots, :, : self.length] = old
        self.k, self.v, self.slots, self.length = new_k, new_v, new_slots, new_len
        self.generation += 1

    def release(self) -> int:
        """Drop every slot (the memory goes back to the allocator); `ensure` grows it again on the next
        admission. Returns the bytes released."""
        freed = self.nbytes()
        self.k, self.v, self.slots, self.length = [], [], 0, 0
        self.generation += 1
        return freed

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    @property
    def bytes_per_token(self) -> int:
        """Keys and values of one position of one slot, all layers."""
        return 2 * self.num_layers * self.kv_heads * self.head_dim * self.dtype.itemsize

    def bytes_for(self, slots: int, length: int) -> int:
        """What `ensure(slots, length)` would make the cache hold, in bytes."""
        return max(slots, self.slots) * max(length, self.length) * self.bytes_per_token

    # ---- slot bookkeeping --------------------------------------------------------------------
    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` positions of slot `src` into `dst` (shared prefill, compaction)."""
        for t in self.k + self.v:
            t[dst, :, :length] = t[src, :, :length]

    # ---- modes set by the engine before each forward -----------------------------------------
    def prefill_into(self, slots: int | list[int], start: int = 0) -> None:
        """Next forward is a prefill of one row per slot (rows right-padded to one width), whose keys/values go to
        those slots from `start` on, attending to each slot's first `start` positions (a reused prefix) as well."""
        index = slots if isinstance(slots, int) else (
            slots[0] if len(slots) == 1 else torch.tensor(slots, device=self.device))
        self._mode, self.fused = ("prefill", index, start), False

    def routed(self, slot: int, length: int) -> np.ndarray | None:
        """A slot's routed experts for routing replay (relayrl.engine.routing.RoutedSlotCache keeps them); None: a
        dense model routes nothing."""
        return None

    def export(self, slot: int, length: int) -> list[torch.Tensor]:
        """A copy of a slot's first `length` positions (all layers, keys then values), to park it."""
        return [t[slot, :, :length].clone() for t in self.k + self.v]

    def restore(self, slot: int, saved: list[torch.Tensor]) -> None:
        for t, s in zip(self.k + self.v, saved):
            t[slot, :, : s.shape[1]] = s

    def decode(self, positions: torch.Tensor, kv_len: int) -> None:
        """Next forward feeds one token per active slot 0..n-1, written at `positions` [n] (int64); it is fused
        (the kernel writes and attends) whenever the engine set a kernel."""
        self._mode = ("decode", positions, kv_len)
        self.fused, self.attended = self.kernel is not None, 0

    def attend(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scale: float) -> torch.Tensor:
        """Fused decode: store this step's key/value and attend over each slot's positions (the kernel)."""
        self.attended += 1
        return decode_attention(self.kernel, query, key, value, self.k[layer_idx], self.v[layer_idx],
                                self._mode[1], scale)

    # ---- the HF Cache protocol (the subset decoder models call) ------------------------------
    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        mode = self._mode[0]
        if mode == "prefill":
            slots, start = self._mode[1], self._mode[2]  # an int (one row) or a tensor of slots
            end = start + key.shape[2]
            one = isinstance(slots, int)
            # stored in the cache's dtype (indexed puts do not cast)
            self.k[layer_idx][slots, :, start:end] = (key[0] if one else key).to(self.dtype)
            self.v[layer_idx][slots, :, start:end] = (value[0] if one else value).to(self.dtype)
            if start == 0:
                return key, value
            rows = slice(slots, slots + 1) if one else slots
            return (self._widen(self.k[layer_idx][rows, :, :end], key),
                    self._widen(self.v[layer_idx][rows, :, :end], key))
        if mode == "decode" and self.fused:
            return key, value  # attend() writes them
        if mode == "decode":
            positions, kv_len = self._mode[1], self._mode[2]
            rows = torch.arange(key.shape[0], device=key.device)
            self.k[layer_idx][rows, :, positions] = key[:, :, 0].to(self.dtype)
            self.v[layer_idx][rows, :, positions] = value[:, :, 0].to(self.dtype)
            n = key.shape[0]
            return (self._widen(self.k[layer_idx][:n, :, :kv_len], key),
                    self._widen(self.v[layer_idx][:n, :, :kv_len], key))
        raise RuntimeError("SlotKVCache.update called outside a prefill/decode step")

    @staticmethod
    def _widen(stored: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """What attention reads: the stored keys/values in the model's dtype (a view when the dtypes agree)."""
        return stored if stored.dtype == like.dtype else stored.to(like.dtype)

    def get_seq_length(self, layer_idx: int = 0) -> int:  # only used by HF when position_ids is None
        raise RuntimeError("SlotKVCache needs explicit position_ids")
