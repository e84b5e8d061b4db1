"""Inference engines: token ids in; token ids, logprobs and policy versions out."""

from relayrl.engine.base import GenOutput, InferenceEngine, SamplingParams
from relayrl.engine.local import LocalEngine
from relayrl.engine.remote import EngineUnavailable, RemoteEngine, RemoteRequestError

__all__ = ["EngineUnavailable", "GenOutput", "InferenceEngine", "LocalEngine", "RemoteEngine", "RemoteRequestError",
           "SamplingParams"]
