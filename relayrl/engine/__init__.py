"""Inference engines: token ids in; token ids, logprobs and policy versions out."""

from relayrl.engine.base import GenOutput, InferenceEngine, SamplingParams
from relayrl.engine.local import LocalEngine

__all__ = ["GenOutput", "InferenceEngine", "LocalEngine", "SamplingParams"]
