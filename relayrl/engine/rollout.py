"""`RolloutController`: the single front of one or more inference engines.

Agents talk only to the controller. It routes each request to an engine -- sticky per trajectory
(`rid`), so the turns of one trajectory land where their KV cache is -- and it fans weight updates,
pauses and versions out to every engine.

Partial rollout: a generation that comes back "abort" (an engine interrupted it, e.g. for a weight
update) is resubmitted with the tokens it already has (`partial_rollout="continue"`: nothing lost, the
versions change mid-sequence) or from scratch (`"requeue"`). With "requeue" the controller aborts every
in-flight generation on a weight update, so no sequence mixes policies.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch

from relayrl.engine.base import GenOutput, InferenceEngine, SamplingParams, TokenCallback
from relayrl.weights.snapshot import NamedTensors, Weights

# LocalEngine.stats that are running totals, read by RolloutController.engine_counters
ENGINE_COUNTERS = ("generated_tokens", "prefill_tokens", "steps", "decode_rows", "busy_s")
_STICKY_MAX = 100_000  # trajectories remembered; the oldest are forgotten first


class RolloutController:
    def __init__(self, engines: list[InferenceEngine], partial_rollout: str = "continue"):
        if not engines:
            raise ValueError("RolloutController needs at least one engine")
        if partial_rollout not in ("continue", "requeue"):
            raise ValueError(f"partial_rollout must be 'continue' or 'requeue', got {partial_rollout!r}")
        self.engines, self.partial_rollout = engines, partial_rollout
        self._next = 0
        self._in_flight = [0] * len(engines)
        self._sticky: OrderedDict[str, int] = OrderedDict()  # rid -> engine index, least recently used first
        self._closing = False
        # weight_update_s: engines paused for updates, in all; weight_pause_s: the part spent waiting for them to
        # stop at a token boundary (the rest is the writing); weight_stage_s: making updates ready before the
        # pause, engines still generating (LocalEngine.stage_weights)
        self.stats = {"requests": 0, "weight_updates": 0, "weight_update_s": 0.0, "weight_pause_s": 0.0,
                      "weight_stage_s": 0.0, "resubmits": 0}

    @property
    def version(self) -> int:
        return min(e.version for e in self.engines)

    def _route(self, rid: str | None) -> int:
        """The index of the engine for `rid`. Sticky per trajectory: a new rid goes to the engine with the
        fewest requests in flight (round-robin among ties) and stays there, so later turns find their KV
        cache. (A hash of the rid spreads badly: crc32 of "traj-0".."traj-3" lands all four on one of two
        engines.)"""
        if len(self.engines) == 1:
            return 0
        if rid is not None and rid in self._sticky:
            self._sticky.move_to_end(rid)
            return self._sticky[rid]
        n = len(self.engines)
        order = [(self._next + k) % n for k in range(n)]
        i = min(order, key=lambda j: self._in_flight[j])
        self._next = (i + 1) % n
        if rid is not None:
            self._sticky[rid] = i
            if len(self._sticky) > _STICKY_MAX:
                self._sticky.popitem(last=False)
        return i

    async def generate(self, input_ids: list[int], params: SamplingParams, rid: str | None = None,
                       on_token: TokenCallback | None = None, images: tuple[bytes, ...] = ()) -> GenOutput:
        """Generate, resubmitting interrupted generations (see the module docstring). `on_token` streams the
        tokens (relayrl.engine.base.TokenCallback): as they are sampled with partial_rollout="continue" (a
        resubmission goes on where the tokens stopped); at the end with "requeue", whose restarts from scratch
        would take back tokens already handed out. `images`: a vision-language prompt's image files, in the order of
        its image placeholders (passed on only when there are any: text engines need not take them)."""
        self.stats["requests"] += 1
        live = on_token if self.partial_rollout == "continue" else None
        with_images = {"images": tuple(images)} if images else {}
        got = GenOutput([], [], [], "abort", len(input_ids))
        while True:
            left = params.max_new_tokens - len(got.output_ids)
            i = self._route(rid)
            self._in_flight[i] += 1
            try:
                out = await self.engines[i].agenerate(input_ids + got.output_ids,
                                                      replace(params, max_new_tokens=left), rid, live,
                                                      **with_images)
            finally:
                self._in_flight[i] -= 1
            tops = None if got.top_logprobs is None and out.top_logprobs is None else \
                (got.top_logprobs or []) + (out.top_logprobs or [])
            got = GenOutput(got.output_ids + out.output_ids, got.logprobs + out.logprobs,
                            got.versions + out.versions, out.finish_reason, len(input_ids), out.meta,
                            stop_string=out.stop_string, top_logprobs=tops,
                            routed_experts=out.routed_experts)  # the last call's covers the earlier tokens too
            if out.finish_reason != "abort" or self._closing or len(got.output_ids) >= params.max_new_tokens:
                for token, logprob in zip(got.output_ids, got.logprobs) if on_token and not live else ():
                    on_token(token, logprob, None)
                return got
            self.stats["resubmits"] += 1
            if self.partial_rollout == "requeue":
                got = GenOutput([], [], [], "abort", len(input_ids))

    def load_weights(self, weights: Weights) -> None:
        """Stage the weights on every engine, still generating; pause every engine at a token boundary; load them,
        which stamps later tokens with `weights.version`; resume.

        Each engine gets its own pass of `weights.named_tensors`, started only when the engine reads it. Engines
        that can (local ones) stage it, still generating: moved to their device and rounded into their dtype; the
        others read it while paused.
        """
        t0 = time.perf_counter()
        version = weights.version
        staged = [e.stage_weights(_FreshPass(weights.named_tensors), version) for e in self.engines]
        t1 = time.perf_counter()
        self.stats["weight_stage_s"] += t1 - t0
        for e in self.engines:
            e.pause()
        self.stats["weight_pause_s"] += time.perf_counter() - t1
        try:
            for e, ready in zip(self.engines, staged, strict=True):
                e.load_weights(ready, version)
                if self.partial_rollout == "requeue":
                    e.abort()  # their generations restart from scratch under the new weights
        except BaseException:
            for e in self.engines:  # best effort: the update's own error (say, a dead server) is the one to see
                with contextlib.suppress(Exception):
                    e.resume()
            raise
        for e in self.engines:
            e.resume()
        self.stats["weight_updates"] += 1
        self.stats["weight_update_s"] += time.perf_counter() - t1

    def engine_counters(self) -> dict[str, float]:
        """The engines' running totals, summed (`ENGINE_COUNTERS` of each engine that keeps them: the embedded
        LocalEngine does, remote servers do not): the loops turn the difference between two readings into a
        step's `engine/*` metrics."""
        totals = dict.fromkeys(ENGINE_COUNTERS, 0.0)
        for engine in self.engines:
            if "steps" in engine.stats:
                for key in ENGINE_COUNTERS:
                    totals[key] += float(engine.stats.get(key, 0))
        return totals

    def release_memory(self, weights: bool = True) -> int:
        """Ask in-process engines to give back their KV cache (and weights) while the trainer runs beside them;
        the next load_weights restores them. Engines in other processes keep theirs. Returns bytes released."""
        return sum(e.release_memory(weights) for e in self.engines)

    def pause(self) -> None:
        for e in self.engines:
            e.pause()

    def resume(self) -> None:
        for e in self.engines:
            e.resume()

    def close(self) -> None:
        self._closing = True
        for e in self.engines:
            e.close()


class _FreshPass:
    """`named_tensors()` as an iterable that calls it when iterated, and not before: an engine that does not stage
    (InferenceEngine.stage_weights' default) starts its pass in load_weights, paused. A source whose call starts a
    collective (an FSDP trainer's gather, relayrl.trainer.leader) must be read once started, so it is started
    only by the engine about to read it, never before a pause that may fail."""

    def __init__(self, named_tensors: Callable[[], NamedTensors]):
        self._named_tensors = named_tensors

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._named_tensors())
