"""`RolloutController`: the single front of one or more inference engines.

Agents talk only to the controller. It routes each request to an engine -- sticky per trajectory
(`rid`), so the turns of one trajectory land where their KV cache is -- and it fans weight updates,
pauses and versions out to every engine.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Iterable

import torch

from relayrl.engine.base import GenOutput, InferenceEngine, SamplingParams


class RolloutController:
    def __init__(self, engines: list[InferenceEngine]):
        if not engines:
            raise ValueError("RolloutController needs at least one engine")
        self.engines = engines
        self._next = 0
        self.stats = {"requests": 0, "weight_updates": 0, "weight_update_s": 0.0}

    @property
    def version(self) -> int:
        return min(e.version for e in self.engines)

    def _route(self, rid: str | None) -> InferenceEngine:
        if len(self.engines) == 1:
            return self.engines[0]
        if rid is not None:  # sticky: same trajectory, same engine
            return self.engines[zlib.crc32(rid.encode()) % len(self.engines)]
        self._next = (self._next + 1) % len(self.engines)
        return self.engines[self._next]

    async def generate(self, input_ids: list[int], params: SamplingParams, rid: str | None = None) -> GenOutput:
        self.stats["requests"] += 1
        return await self._route(rid).agenerate(input_ids, params, rid)

    def update_weights(self, named_tensors: Callable[[], Iterable[tuple[str, torch.Tensor]]], version: int) -> None:
        """Pause every engine at a token boundary, load the weights, bump the version, resume.

        `named_tensors` is a callable returning a fresh iterator, so each engine gets its own pass.
        """
        t0 = time.perf_counter()
        for e in self.engines:
            e.pause()
        try:
            for e in self.engines:
                e.update_weights(named_tensors(), version)
        finally:
            for e in self.engines:
                e.resume()
        self.stats["weight_updates"] += 1
        self.stats["weight_update_s"] += time.perf_counter() - t0

    def pause(self) -> None:
        for e in self.engines:
            e.pause()

    def resume(self) -> None:
        for e in self.engines:
            e.resume()

    def close(self) -> None:
        for e in self.engines:
            e.close()
