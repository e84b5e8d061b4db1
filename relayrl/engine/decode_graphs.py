"""Decode steps replayed as CUDA graphs: a LocalEngine on a GPU launches a whole decode step at once.

Why: a decode step of a small model is hundreds of tiny kernels, and PyTorch + transformers spend several
microseconds of host time launching each, so on a fast GPU the step waits on the host, which needs many times
longer to launch it than the GPU needs to compute it (docs/benchmarks.md, "On a GPU"). A CUDA graph records one
step's kernels once and replays them with a single launch.

A graph replays fixed shapes at fixed addresses, so the step it records is a *static* one: the batch is padded up to
a bucket (1, 2, 4, 8, 16, 24, ... sequences), attention runs over the KV cache's whole length with a mask built on the
device from the positions, and the inputs are copied into tensors the step owns. Padding rows write their keys and
values at position 0 of free slots (whatever is admitted there later is prefilled over them) and their logits are
dropped. The same static step runs eagerly anywhere (`capture=False`): the tests check it against the engine's own
step on a CPU, token by token; only a CUDA device records it.

Graphs are recorded lazily, one per bucket, and forgotten whenever the KV cache is reallocated (it grew or was
released: `SlotKVCache.generation`) or the engine's weight storage changes (`reset`), because a graph holds raw
addresses. Weights updated in place (every weight sync) keep their addresses, so graphs survive training steps.
If recording fails, the engine logs why and decodes eagerly from then on: graphs are a speed-up, never a new way
to fail.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass

import torch

from relayrl.engine.kv_cache import SlotKVCache

log = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """Padded batch sizes: powers of two to 8, then every 8 to 64, then every 16 (padding wastes at most ~25%
    of a small batch and one sixteenth row group of a large one; each bucket costs one recorded graph)."""
    sizes = [1, 2, 4, 8]
    while sizes[-1] < max_batch:
        sizes.append(sizes[-1] + (8 if sizes[-1] < 64 else 16))
    return sizes


@dataclass
class _Step:
    """The tensors one bucket's graph reads and writes; `io` holds the token ids (row 0) and positions (row 1)."""

    io: torch.Tensor  # [2, bucket] int64 on the model's device
    logits: torch.Tensor | None = None  # [bucket, vocab], written by every replay
    graph: torch.cuda.CUDAGraph | None = None


class StaticDecode:
    """Padded, full-length decode steps for a LocalEngine's model and slot cache, recorded as CUDA graphs when
    `capture` (the engine's setting on a CUDA device), else run eagerly (tests)."""

    def __init__(self, model: torch.nn.Module, cache: SlotKVCache, max_batch: int, capture: bool,
                 max_cache_bytes: int | None = None):
        self.model, self.cache, self.capture = model, cache, capture
        self.max_cache_bytes = max_cache_bytes  # the engine's KV budget: padding never grows the cache beyond it
        self.buckets = batch_buckets(max_batch)
        self.failed: str | None = None  # why recording failed (the engine then decodes eagerly)
        self.recorded = 0  # graphs recorded so far (all buckets, all cache generations)
        self._steps: dict[int, _Step] = {}
        self._generation = -1  # the cache generation the steps were made for

    def reset(self) -> None:
        """Forget every recorded step (the weights' or the cache's storage moved)."""
        self._steps.clear()
        self._generation = -1

    def forward(self, tokens: list[int], kv_lens: list[int]) -> torch.Tensor | None:
        """Logits [n, vocab] of one decode step of slots 0..n-1 (token i at position kv_lens[i]), or None when this
        step cannot be static (no bucket this large, the KV budget has no room for padding, recording failed):
        the caller then runs its own step."""
        n = len(tokens)
        at = bisect.bisect_left(self.buckets, n)
        if self.failed or at == len(self.buckets):
            return None
        bucket = self.buckets[at]
        if bucket > self.cache.slots:
            if self.max_cache_bytes and self.cache.bytes_for(bucket, self.cache.length) > self.max_cache_bytes:
                return None
            self.cache.ensure(bucket, self.cache.length)  # padding rows need slots of their own
        if self._generation != self.cache.generation:
            self.reset()
            self._generation = self.cache.generation
        step = self._steps.get(bucket)
        if step is None:
            step = self._steps[bucket] = _Step(torch.zeros(2, bucket, dtype=torch.long, device=self.cache.device))
        pad = [0] * (bucket - n)
        step.io.copy_(torch.tensor([list(tokens) + pad, list(kv_lens) + pad]))
        if not self.capture:
            return self._run(step)[:n]
        if step.graph is None and not self._record(step):
            return None
        step.graph.replay()
        return step.logits[:n]

    def _run(self, step: _Step) -> torch.Tensor:
        """One static step: every row of the bucket, attention over the cache's whole length."""
        length = self.cache.length
        positions = step.io[1]
        self.cache.decode(positions, length)
        mask = (torch.arange(length, device=positions.device)[None, :] <= positions[:, None])[:, None, None, :]
        out = self.model(input_ids=step.io[0][:, None], position_ids=positions[:, None], attention_mask=mask,
                         cache=self.cache, use_cache=True)
        return out.logits[:, -1]

    def _record(self, step: _Step) -> bool:
        """Warm up once on a side stream (lazy initialisations must not land in the graph), then record. The warm-up
        is this step itself: it writes the same keys and values the replay writes again. Recorded with
        capture_error_mode="thread_local": the default ("global") makes any other thread's synchronous CUDA call
        fail while a step records, and others run beside the engine (a producer staging a weight update,
        relayrl.engine.weights; a trainer thread in a colocated async run). Theirs run on their own streams."""
        device = self.cache.device
        try:
            side = torch.cuda.Stream(device=device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                self._run(step)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                step.logits = self._run(step)
        except Exception as e:  # noqa: BLE001 - any failure: decode eagerly, never fail the requests for it
            self.failed = f"{type(e).__name__}: {e}"
            self.reset()
            log.warning("LocalEngine: recording a decode step as a CUDA graph failed (%s); decoding without graphs",
                        self.failed)
            return False
        step.graph = graph
        self.recorded += 1
        return True
