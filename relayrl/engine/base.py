"""The inference-engine contract: token ids in, token ids + logprobs + policy versions out.

Every engine (the in-process `LocalEngine`, HTTP `RemoteEngine`s) speaks in token ids. Agents never
send text to an engine; they tokenize only the text they add themselves (prompts, feedback, tool
results). This is what keeps multi-turn trajectories token-exact.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from relayrl.engine.scoring import Scored

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


class NotSupported(RuntimeError):
    """An engine was asked for an optional capability it does not have (see `InferenceEngine`)."""


NamedTensors = Iterable[tuple[str, torch.Tensor]]


class InferenceEngine(ABC):
    """Everything the rest of relayrl may ask of an engine, declared here and nowhere else.

    Callers (relayrl.engine.rollout, relayrl.run.sources, ...) call these methods on any engine and never probe for
    one. The abstract ones every engine implements; the rest are optional capabilities whose default says, in this
    one place, what an engine without them does: nothing (nothing to stage, release, flush or restore), or
    `NotSupported`. `LocalEngine` and `RemoteEngine` override what they support.
    """

    # running totals since the engine started: relayrl.engine.rollout.ENGINE_COUNTERS when it keeps them (the
    # embedded LocalEngine does; a remote engine counts only its requests, and the loops then report no engine/*)
    stats: dict[str, Any]

    @property
    @abstractmethod
    def version(self) -> int:
        """The policy version of the weights it holds (stamped on each token it samples)."""

    @abstractmethod
    async def agenerate(self, input_ids: list[int], params: SamplingParams, rid: str | None = None,
                        on_token: TokenCallback | None = None, images: tuple[bytes, ...] = ()) -> GenOutput:
        """Generate from `input_ids`; `rid` names the trajectory (KV reuse, abort), `on_token` streams the tokens
        (TokenCallback), `images`: a vision-language prompt's image files (relayrl.engine.vision), only when any."""

    # a weight update is two steps: stage (while still generating), then load (paused)
    def stage_weights(self, named_tensors: NamedTensors, version: int) -> NamedTensors:
        """Make an update ready while still generating, before the pause for `load_weights`, and return what
        that should load. Default: nothing to stage, the tensors are returned unread (a lazy source is read only
        by `load_weights`, while paused)."""
        return named_tensors

    @abstractmethod
    def load_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """Load new weights (from `stage_weights`' result) and stamp later tokens with `version`; called paused."""

    @abstractmethod
    def load_weights_from_disk(self, path: str, version: int) -> None:
        """Load the *.safetensors files of folder `path` as the weights of `version`."""

    @abstractmethod
    def pause(self) -> None:
        """Stop generating at a token boundary; running requests keep their state."""

    @abstractmethod
    def resume(self) -> None:
        """Generate again after `pause`."""

    @abstractmethod
    def abort(self, rid: str | None = None) -> int:
        """Finish the requests of trajectory `rid` (all if None) with finish_reason "abort"; how many it aborted
        (0 when the engine cannot tell)."""

    def num_running(self) -> int:
        """Requests waiting or generating; default -1: the engine cannot tell."""
        return -1

    def flush_cache(self) -> None:
        """Forget cached KV of finished requests (computed by older weights). Default: no cache, nothing to do."""
        return

    def release_memory(self, weights: bool = True) -> int:
        """Give back the KV cache (and with `weights`, the weights) while the trainer in this process needs the
        memory; the next `load_weights` restores them. Returns the bytes freed. Default 0: an engine in another
        process keeps its memory."""
        return 0

    def rng_state(self) -> torch.Tensor | None:
        """The state of the generator that samples requests without a seed, for checkpoints. Default None: the
        engine's sampling state is not relayrl's (a server's own), so a resume cannot restore it."""
        return None

    def set_rng_state(self, state: torch.Tensor | None) -> None:
        """Restore `rng_state()`'s output. Default: nothing to restore."""
        return

    def score(self, input_ids: list[int], top_k: int = 0, temperature: float = 1.0) -> Scored:
        """Each token's logprob given the ones before it (prompt logprobs). Default: `NotSupported`."""
        raise NotSupported(f"{type(self).__name__} does not score prompts (engine.kind=local does)")

    @abstractmethod
    def close(self) -> None:
        """Release the engine's threads and connections; idempotent."""
