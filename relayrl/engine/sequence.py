"""`Seq`: one generation request as LocalEngine runs it: prompt, sampling settings, the tokens so far, its KV state."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field

import numpy as np
import torch

from relayrl.engine.base import GenOutput, SamplingParams, TokenCallback


@dataclass
class Seq:
    prompt: list[int]
    params: SamplingParams
    future: concurrent.futures.Future
    stop_ids: frozenset[int]
    generator: torch.Generator | None
    out_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    kv_len: int = 0  # positions written to the KV cache (the last sampled token is not yet written)
    prompt_logits: torch.Tensor | None = None  # last-position logits of the prompt, for prefix sharing
    rid: str | None = None
    refill: bool = False  # rebuild this sequence's KV before its next step (weights changed)
    stop_string: str | None = None  # the stop string its text came to contain (relayrl.engine.stops)
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per output token, when params.top_logprobs > 0
    on_token: TokenCallback | None = None  # a streaming request's listener (relayrl.engine.base.TokenCallback)
    routed_experts: np.ndarray | None = None  # an MoE model's experts per position, set as it leaves its slot

    @property
    def cost(self) -> int:
        return len(self.prompt) + self.params.max_new_tokens

    def output(self, reason: str) -> GenOutput:
        return GenOutput(self.out_ids, self.logprobs, self.versions, reason, len(self.prompt),
                         stop_string=self.stop_string, top_logprobs=self.top_logprobs,
                         routed_experts=self.routed_experts)


def resolve(seq: Seq, out: GenOutput) -> None:
    if not seq.future.done():  # a caller may have cancelled it
        seq.future.set_result(out)
