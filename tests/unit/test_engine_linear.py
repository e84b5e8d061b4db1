"""relayrl.engine.linear: a CPU engine's fp32 linears through oneDNN, on the real tiny model."""

import pytest
import torch
import torch.nn.functional as F
from device_checks import GREEDY, PROMPTS, full_forward_logprobs

from relayrl.common import hardware
from relayrl.engine import linear
from relayrl.engine.base import SamplingParams
from relayrl.engine.local import LocalEngine
from relayrl.models import load_model

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this PyTorch has no oneDNN")


@needs_onednn
def test_an_engine_on_onednn_linears_is_exact_and_samples_what_the_default_samples(tiny_path):
    eng = LocalEngine(load_model(tiny_path, dtype="float32"), eos_token_ids=[], max_batch_size=4, linear="onednn")
    plain = LocalEngine(load_model(tiny_path, dtype="float32"), eos_token_ids=[], max_batch_size=4, linear="default")
    try:
        assert (eng.linear, plain.linear) == ("onednn", "default")
        head = eng.model.get_output_embeddings()
        assert head.forward.__func__ is linear._forward  # the path under test is the one the engine runs
        outs = eng.generate(PROMPTS, SamplingParams(max_new_tokens=16, temperature=1.0, ignore_eos=True))
        for prompt, out in zip(PROMPTS, outs):
            ref = full_forward_logprobs(eng.model, prompt, out.output_ids, 1.0)  # no inference mode: F.linear
            assert torch.allclose(torch.tensor(out.logprobs), ref, atol=1e-5), prompt
        got, want = eng.generate(PROMPTS, GREEDY), plain.generate(PROMPTS, GREEDY)
        assert [o.output_ids for o in got] == [o.output_ids for o in want]
    finally:
        eng.close()
        plain.close()


@needs_onednn
def test_training_through_a_patched_model_keeps_autograd(tiny_path):
    """A model shared by engine and trainer: outside inference mode the patched layers are plain F.linear."""
    model = load_model(tiny_path, dtype="float32")
    assert linear.install(model)
    head = model.get_output_embeddings()
    x = torch.randn(3, 5, head.in_features, requires_grad=True)
    y = head(x)
    assert y.grad_fn is not None and torch.equal(y, F.linear(x, head.weight))
    y.sum().backward()
    assert head.weight.grad is not None and x.grad is not None
    with torch.inference_mode():
        fast = head(x.detach())
    assert fast.shape == y.shape and torch.allclose(fast, y.detach(), rtol=1e-4, atol=1e-5)


def test_the_choice_is_measured_once_per_machine_and_follows_the_measurement(tmp_path, monkeypatch):
    monkeypatch.setattr(hardware, "cache_dir", lambda: tmp_path)
    calls = []

    def fake(default_s, onednn_s, agree=True):
        def measure():
            calls.append(1)
            return {"default_s": default_s, "onednn_s": onednn_s, "agree": agree}
        return measure

    monkeypatch.setattr(linear, "_measure", fake(2.0, 1.0))
    if not torch.backends.mkldnn.is_available():
        assert linear.onednn_is_faster()[0] is False
        return
    assert linear.onednn_is_faster() == (True, "oneDNN 2.00x PyTorch's default at an LM head's decode shapes "
                                               "(measured, cached)")
    assert linear.onednn_is_faster()[0] and len(calls) == 1  # cached: measured once
    for params, want in (((1.0, 1.0), False), ((2.0, 1.0, False), False)):  # no gain; results that disagree
        (tmp_path / "hardware.json").unlink()
        monkeypatch.setattr(linear, "_measure", fake(*params))
        assert linear.onednn_is_faster()[0] is want


def test_a_bad_linear_setting_is_refused(tiny_path):
    with pytest.raises(ValueError, match="linear must be"):
        LocalEngine(load_model(tiny_path, dtype="float32"), eos_token_ids=[], linear="mkl")
