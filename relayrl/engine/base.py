"""The inference-engine contract: token ids in, token ids + logprobs + policy versions out.

Every engine (the in-process `LocalEngine`, HTTP `RemoteEngine`s) speaks in token ids. Agents never
send text to an engine; they tokenize only the text they add themselves (prompts, feedback, tool
results). This is what keeps multi-turn trajectories token-exact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

# A streaming request's listener (LocalEngine.submit's `on_token`): called on the engine's worker thread with each
# token as it is sampled -- (token id, its logprob, its top_logprobs alternatives or None) -- before the engine
# checks whether that token ends the request, so the last one comes too. It must return at once (hand the token
# to another thread; relayrl.serve.streaming does) and never raise: one that raises is dropped, the request runs on.
# The request's GenOutput is the same with or without one.
TokenCallback = Callable[[int, float, "list[tuple[int, float]] | None"], None]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. temperature 0 means greedy.

    Returned logprobs are those of the temperature-scaled distribution *before* top-k/top-p
    truncation, which is what the trainer recomputes (log_softmax(logits / temperature)).

    `stop_strings`: generation ends at the first token after which the generated text contains one of them
    (relayrl.engine.stops). The engine still returns every token it sampled, the one that completed the stop
    string included, with its logprob, so training data stays exact; cutting the text before the stop string
    (OpenAI's semantics) is the text's consumer's business (relayrl.engine.stops.cut_at_stop).
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    stop_token_ids: tuple[int, ...] = ()  # in addition to the engine's EOS ids
    ignore_eos: bool = False
    seed: int | None = None  # per-request seed: same seed, same tokens, whatever the batch around it
    stop_strings: tuple[str, ...] = ()  # text that ends generation (see above)
    # alternatives to return per generated token: the most likely tokens of the same distribution the sampled
    # token's logprob is taken from (so it is among them, with the same value, when it ranks that high); 0 = none
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop_strings, str):  # a bare string would be read as one stop per character
            raise ValueError(f"stop_strings must be a tuple of strings, got the string {self.stop_strings!r}")
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))  # a list is hashable once a tuple
        if not all(isinstance(s, str) and s for s in self.stop_strings):
            raise ValueError(f"stop_strings must be non-empty strings, got {self.stop_strings!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be >= 0, got {self.top_logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class GenOutput:
    """What one generation call produced."""

    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]  # policy version that sampled each token
    finish_reason: str  # "stop" (EOS / stop token / stop string, included in output_ids), "length", "abort"
    prompt_len: int
    meta: dict = field(default_factory=dict)
    stop_string: str | None = None  # the stop string that ended it (finish_reason "stop"), if one did
    # per output token, its SamplingParams.top_logprobs most likely (token id, logprob), most likely first; None
    # when none were asked for
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # a mixture-of-experts model's routed experts [positions, MoE layers, k] (uint8/int16) for the prompt and every
    # output token but the last, for rollout routing replay (relayrl.engine.routing); None for dense models
    routed_experts: np.ndarray | None = None


@runtime_checkable
class InferenceEngine(Protocol):
    """What the RolloutController needs from an engine."""

    @property
    def version(self) -> int: ...

    async def agenerate(
        self, input_ids: list[int], params: SamplingParams, rid: str | None = None,
        on_token: TokenCallback | None = None, images: tuple[bytes, ...] = (),
    ) -> GenOutput: ...  # images: a vision-language prompt's image files (relayrl.engine.vision); only when any

    def update_weights(self, named_tensors, version: int) -> None: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def abort(self, rid: str | None = None) -> int: ...

    def close(self) -> None: ...
