"""The inference-engine contract: token ids in, token ids + logprobs + policy versions out.

Every engine (the in-process `LocalEngine`, HTTP `RemoteEngine`s) speaks in token ids. Agents never
send text to an engine; they tokenize only the text they add themselves (prompts, feedback, tool
results). This is what keeps multi-turn trajectories token-exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. temperature 0 means greedy.

    Returned logprobs are those of the temperature-scaled distribution *before* top-k/top-p
    truncation, which is what the trainer recomputes (log_softmax(logits / temperature)).
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    stop_token_ids: tuple[int, ...] = ()  # in addition to the engine's EOS ids
    ignore_eos: bool = False
    seed: int | None = None  # per-request seed: same seed, same tokens, whatever the batch around it

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class GenOutput:
    """What one generation call produced."""

    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]  # policy version that sampled each token
    finish_reason: str  # "stop" (EOS / stop token, included in output_ids), "length", "abort"
    prompt_len: int
    meta: dict = field(default_factory=dict)


@runtime_checkable
class InferenceEngine(Protocol):
    """What the RolloutController needs from an engine."""

    @property
    def version(self) -> int: ...

    async def agenerate(
        self, input_ids: list[int], params: SamplingParams, rid: str | None = None
    ) -> GenOutput: ...

    def update_weights(self, named_tensors, version: int) -> None: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def abort(self, rid: str | None = None) -> int: ...

    def close(self) -> None: ...
