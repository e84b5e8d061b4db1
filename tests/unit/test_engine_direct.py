"""relayrl.engine.direct: a CPU engine's written-out decode step gives the HF forward's tokens and logprobs, is used
only where it covers the model, and is dropped when its check against the HF forward fails."""

from __future__ import annotations

import copy

import pytest
import torch

from relayrl.engine import attention, direct
from relayrl.engine.base import SamplingParams
from relayrl.engine.local import LocalEngine
from relayrl.models import eos_token_ids, load_model, load_tokenizer, tiny_model

PROMPTS = [[5, 6, 7, 8, 9], [20, 21], [30] * 17, [40, 41, 42], [7], [50, 51, 52, 53]]


def _engine(path: str) -> LocalEngine:
    model = load_model(path, dtype="float32")
    return LocalEngine(model, eos_token_ids=eos_token_ids(load_tokenizer(path), path), max_batch_size=4)


def _run(path: str) -> tuple[bool, list]:
    eng = _engine(path)
    try:
        params = SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True, seed=3)
        return eng.direct, eng.generate(PROMPTS, params)  # 6 requests through 4 slots: rows join and leave
    finally:
        eng.close()


@pytest.mark.skipif(attention.load_kernel() is None, reason="no C compiler: no fused decode step to write out")
@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # q/k/v biases, and none
def test_the_written_out_step_samples_what_the_hf_forward_samples(arch, monkeypatch):
    path = str(tiny_model(arch))
    on, outs = _run(path)
    assert on
    monkeypatch.setattr(direct, "why_not", lambda model: "switched off by the test")
    off, ref = _run(path)
    assert not off
    for got, want in zip(outs, ref):
        assert got.output_ids == want.output_ids
        assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5)


def _raises(*args):
    raise RuntimeError("planted")


@pytest.mark.skipif(attention.load_kernel() is None, reason="no C compiler: no fused decode step to write out")
@pytest.mark.parametrize("fault", ["differs", "raises"])
def test_a_written_out_step_that_differs_from_the_hf_forward_or_fails_is_dropped(tiny_path, monkeypatch, fault):
    plain = direct.decode_logits
    monkeypatch.setattr(direct, "decode_logits", (lambda *a: plain(*a) + 0.01) if fault == "differs" else _raises)
    eng = _engine(tiny_path)
    try:
        assert not eng.direct
        assert eng.cache.kernel is not None  # the kernel stays: only the HF forward runs the step
        out = eng.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))
        assert len(out[0].output_ids) == 4
    finally:
        eng.close()


def test_models_it_does_not_cover_are_named(tiny_path):
    model = load_model(tiny_path, dtype="float32")
    assert direct.why_not(model) is None
    for key, value, words in [("rope_parameters", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
                               "changes with the length"),
                              ("hidden_act", "gelu", "activation"), ("model_type", "gemma", "model type")]:
        other = copy.copy(model)
        other.config = copy.deepcopy(model.config)
        setattr(other.config, key, value)
        assert words in direct.why_not(other)
