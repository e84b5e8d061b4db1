"""The engine's batch step: admit waiting requests into KV slots, prefill, decode one token for every running
sequence, sample, retire the finished. `LocalEngine` (relayrl.engine.local) owns the state and the worker thread and
calls these between its locks; they live apart so that the public face (submit, weights, pause, close) and the step
each stay readable. Every method here runs on the engine's worker thread, or under its step lock.
"""

from __future__ import annotations

from collections import OrderedDict, deque

import torch

from relayrl.engine import direct, routing
from relayrl.engine.decode_graphs import StaticDecode
from relayrl.engine.kv_cache import SlotKVCache
from relayrl.engine.prefill import SharedStart, prefill
from relayrl.engine.sampling import sample_tokens
from relayrl.engine.sequence import Seq, resolve
from relayrl.engine.stops import Decode
from relayrl.engine.tokens import append_sampled, finish_reason
from relayrl.engine.vision import EngineVision


class BatchStep:
    """The step's methods over the state `LocalEngine.__init__` sets up (declared here, set there)."""

    model: torch.nn.Module
    device: torch.device
    cache: SlotKVCache
    decode: Decode | None
    max_batch_size: int
    max_seq_len: int
    max_tokens_in_flight: int | None
    kv_cache_bytes: int | None
    prefill_tokens: int
    prefix_cache_size: int
    skinny_rows: int
    direct: bool
    stats: dict
    _active: list[Seq]
    _waiting: deque[Seq]
    _parked: OrderedDict[str, tuple[list[int], list[torch.Tensor]]]
    _start: SharedStart
    _static: StaticDecode | None
    _generator: torch.Generator
    _sample_work: torch.Tensor
    _version: int
    vision: EngineVision | None

    def _take_admissible(self) -> list[Seq]:
        """Waiting requests that fit the free slots, the tokens-in-flight budget and the KV cache's byte budget
        (called under _cond); the first in line always fits an empty engine (submit checks it)."""
        used = sum(q.cost for q in self._active)
        new: list[Seq] = []
        kv_len = 0
        while self._waiting and len(self._active) + len(new) < self.max_batch_size:
            head = self._waiting[0]
            cost, head_len = head.cost, self._kv_len(len(head.prompt), head.params.max_new_tokens)
            if self.max_tokens_in_flight and used + cost > self.max_tokens_in_flight and (self._active or new):
                break
            if not self._kv_fits(len(new) + 1, max(kv_len, head_len)):
                break
            new.append(self._waiting.popleft())
            used, kv_len = used + cost, max(kv_len, head_len)
        return new

    def _kv_len(self, prompt_len: int, max_new_tokens: int) -> int:
        """The cache length a request needs (what `_admit` grows the cache to)."""
        return min(_round_up(prompt_len + max_new_tokens, 64), self.max_seq_len)

    def _kv_fits(self, n_new: int, length: int) -> bool:
        """Would the cache, grown for n_new more sequences of up to `length` positions, stay within budget? An
        idle engine's cache is reshaped from scratch (`_admit`), so only the new requests count then."""
        if not self.kv_cache_bytes:
            return True
        if not self._active:
            return n_new * length * self.cache.bytes_per_token <= self.kv_cache_bytes
        return self.cache.bytes_for(len(self._active) + n_new, length) <= self.kv_cache_bytes

    def _drop_cancelled(self) -> None:
        for i in range(len(self._active) - 1, -1, -1):
            if self._active[i].future.cancelled():
                self._release(i)

    def _refill(self) -> None:
        """Rebuild the KV of sequences that were running when the weights changed (in batched prefills)."""
        slots = [slot for slot, seq in enumerate(self._active) if seq.refill]
        if slots:
            self._prefill([self._active[i].prompt + self._active[i].out_ids[:-1] for i in slots], slots)
        for i in slots:
            self._active[i].refill = False

    def _admit(self, new: list[Seq]) -> None:
        """Prefill each distinct prompt once (reusing a parked prefix or a running twin's KV if any; the rest in
        batched forwards, relayrl.engine.prefill); one slot per request."""
        groups: dict[tuple[int, ...], list[Seq]] = {}
        for seq in new:
            groups.setdefault(tuple(seq.prompt), []).append(seq)
        need_len = max((self._kv_len(len(s.prompt), s.params.max_new_tokens) for s in new), default=0)
        slots = len(self._active) + len(new)
        if self.kv_cache_bytes and not self._active and self.cache.bytes_for(slots, need_len) > self.kv_cache_bytes:
            self.cache.release()  # idle: a different shape (more slots, shorter) fits the budget where growing won't
        self.cache.ensure(slots, need_len)
        plan, fresh, first = [], [], len(self._active)  # (prompt, seqs, first slot, twin slot, logits) per group
        for prompt, seqs in groups.items():
            twin = self._running_twin(prompt)
            logits = None if twin is None else self._active[twin].prompt_logits
            if twin is None and (reused := self._reuse(seqs[0], first)):
                logits = self._prefill([list(prompt)], [first], reused)[0]
            elif twin is None:
                fresh.append(len(plan))
            plan.append([prompt, seqs, first, twin, logits])
            first += len(seqs)
        if fresh:
            for i, logits in zip(fresh, self._prefill([list(plan[i][0]) for i in fresh], [plan[i][2] for i in fresh])):
                plan[i][4] = logits
        for prompt, seqs, first, twin, logits in plan:
            for i in range(0 if twin is not None else 1, len(seqs)):
                self.cache.copy_slot(first if twin is None else twin, first + i, len(prompt))
            for seq in seqs:
                seq.kv_len = len(prompt)
                seq.prompt_logits = logits
                self._active.append(seq)
            self._sample_and_append(seqs, logits.expand(len(seqs), -1))
        self._retire_finished()

    def _running_twin(self, prompt: tuple[int, ...]) -> int | None:
        """Slot of a running sequence with exactly this prompt (GRPO samples that arrived late)."""
        for slot, seq in enumerate(self._active):
            if len(seq.prompt) == len(prompt) and seq.prompt_logits is not None and tuple(seq.prompt) == prompt:
                return slot
        return None

    def _reuse(self, seq: Seq, slot: int) -> int:
        """Restore the parked KV of seq's trajectory into `slot` if seq's prompt extends it; tokens reused."""
        parked = self._parked.pop(seq.rid, None) if seq.rid is not None else None
        if parked is None:
            return 0
        tokens, kv = parked
        if len(tokens) >= len(seq.prompt) or seq.prompt[: len(tokens)] != tokens:
            return 0
        self.cache.restore(slot, kv)
        self.stats["reused_tokens"] += len(tokens)
        return len(tokens)

    def _prefill(self, rows: list[list[int]], slots: list[int], start: int = 0) -> torch.Tensor:
        """Run rows[i][start:] through the model into slots[i] (positions < start are cached); last logits [n, V]."""
        logits, computed = prefill(self.model, self.cache, rows, slots, start, self.prefill_tokens, self._start,
                                   self.vision)
        self.stats["prefill_tokens"] += computed
        self.stats["prefills"] += len(rows)
        return logits

    def _forward_decode(self, tokens: list[int], kv_lens: list[int]) -> torch.Tensor:
        """One token for each of slots 0..n-1, at positions `kv_lens`; returns the logits [n, vocab]. The
        lengths come as a list so that the mask's width is known without reading back from the device. On a GPU the
        step is a replayed CUDA graph where it can be (relayrl.engine.decode_graphs)."""
        if self._static is not None and (logits := self._static.forward(tokens, kv_lens)) is not None:
            return logits
        dev = self.device
        kv_len = max(kv_lens) + 1
        positions = torch.tensor(kv_lens, device=dev)
        self.cache.decode(positions, kv_len)
        mask = (torch.arange(kv_len, device=dev)[None, :] <= positions[:, None])[:, None, None, :]
        if self.cache.fused and self.direct:  # written out (relayrl.engine.direct)
            logits = direct.decode_logits(self.model, self.cache, torch.tensor(tokens, device=dev), positions,
                                          self.skinny_rows)
        else:
            extra = {"relayrl_cache": self.cache} if self.cache.fused else {}
            logits = self.model(input_ids=torch.tensor(tokens, device=dev)[:, None], position_ids=positions[:, None],
                                attention_mask=mask, cache=self.cache, use_cache=True, **extra).logits[:, -1]
        if self.cache.fused and self.cache.attended != self.cache.num_layers:
            raise RuntimeError(f"decode kernel ran for {self.cache.attended} of the model's layers")
        return logits

    def _decode_step(self) -> None:
        seqs = self._active
        logits = self._forward_decode([s.out_ids[-1] for s in seqs], [s.kv_len for s in seqs])
        for s in seqs:
            s.kv_len += 1
        self.stats["steps"] += 1
        self.stats["decode_rows"] += len(seqs)
        self._sample_and_append(seqs, logits)
        self._retire_finished()

    def _sample_and_append(self, seqs: list[Seq], logits: torch.Tensor) -> None:
        if self._sample_work.numel() < logits.numel():
            self._sample_work = torch.empty(logits.numel(), device=self.device)
        sampled = sample_tokens(logits, [s.params for s in seqs], [s.generator for s in seqs], self._generator,
                                self._sample_work)
        append_sampled(seqs, *sampled, self._version)  # relayrl.engine.tokens: recorded, then streamed
        self.stats["generated_tokens"] += len(seqs)

    def _retire_finished(self) -> None:
        """Resolve finished requests, park their KV for the trajectory's next turn, free their slots."""
        for i in range(len(self._active) - 1, -1, -1):
            seq = self._active[i]
            reason = finish_reason(seq, self.decode, self.max_seq_len)
            if reason is None:
                continue
            if seq.rid is not None and self.prefix_cache_size > 0:
                self._parked[seq.rid] = (seq.prompt + seq.out_ids[:-1], self.cache.export(i, seq.kv_len))
                while len(self._parked) > self.prefix_cache_size:
                    self._parked.popitem(last=False)
            resolve(self._release(i), seq.output(reason))

    def _release(self, i: int) -> Seq:
        """Remove the sequence in slot i, keeping slots dense (the last slot moves into the hole)."""
        seq, last = self._active[i], len(self._active) - 1
        routing.keep_routes(self.cache, seq, i)
        if i != last:
            self.cache.copy_slot(last, i, self._active[last].kv_len)
            self._active[i] = self._active[last]
        self._active.pop()
        return seq


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple
