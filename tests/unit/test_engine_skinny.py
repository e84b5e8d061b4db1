"""relayrl.engine.skinny: a CPU engine's few-row fp32 linears through the C kernel, checked against F.linear and on
the real tiny model (logprobs against a plain forward, tokens against an engine on PyTorch's linears)."""

import pytest
import torch
import torch.nn.functional as F
from device_checks import GREEDY, PROMPTS, full_forward_logprobs

from relayrl.common import hardware
from relayrl.engine import skinny
from relayrl.engine.base import SamplingParams
from relayrl.engine.local import LocalEngine
from relayrl.models import load_model

needs_kernel = pytest.mark.skipif(skinny.load_kernel() is None, reason="no C compiler: the kernel did not build")


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 9, 17, 32, 47, 64])  # both loops, every tile shape
@pytest.mark.parametrize("k", [13, 64, 576])  # a width that is not a multiple of the kernel's 8 lanes, and real ones
def test_the_kernel_computes_what_f_linear_computes(rows, k):
    torch.manual_seed(rows * 1000 + k)
    wide = torch.randn(rows, k + 5)
    x = wide[:, 2:k + 2]  # rows with a stride of their own: the kernel reads them in place
    w, b = torch.randn(101, k), torch.randn(101)  # 2 chunks of 48 weight rows and a 5-row edge
    got = skinny.skinny_linear(skinny.load_kernel(), x, w, b)
    # a k-term dot product of unit normals summed in another order than oneDNN's: error ~sqrt(k) u |x||w| ~ k u
    # (|x||w| ~ sqrt(k)); atol 1e-5 sqrt(k) leaves ~100x that at k = 576, on every target
    assert torch.allclose(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5 * k**0.5)
    batched = skinny.skinny_linear(skinny.load_kernel(), x.reshape(1, rows, k), w, None)  # leading dims kept
    assert batched.shape == (1, rows, 101) and torch.allclose(batched[0], F.linear(x, w), rtol=1e-5, atol=1e-4)


@needs_kernel
def test_more_rows_than_the_kernel_takes_are_refused():
    with pytest.raises(RuntimeError, match="at most 64"):
        skinny.skinny_linear(skinny.load_kernel(), torch.randn(65, 8), torch.randn(4, 8), None)


@needs_kernel
@pytest.mark.parametrize("rows", [4, 64])  # the streaming loop alone; the tiled loop (7 running sequences) too
def test_an_engine_on_the_kernel_is_exact_and_samples_what_pytorch_samples(tiny_path, monkeypatch, rows):
    calls = []
    real = skinny.skinny_linear
    monkeypatch.setattr(skinny, "skinny_linear", lambda *a: calls.append(a[1].shape[:-1]) or real(*a))
    eng = LocalEngine(load_model(tiny_path, dtype="float32"), eos_token_ids=[], max_batch_size=8, skinny_rows=rows)
    plain = LocalEngine(load_model(tiny_path, dtype="float32"), eos_token_ids=[], max_batch_size=8, linear="default")
    try:
        assert (eng.skinny_rows, plain.skinny_rows) == (rows, 0)
        outs = eng.generate(PROMPTS, SamplingParams(max_new_tokens=16, temperature=1.0, ignore_eos=True))
        for prompt, out in zip(PROMPTS, outs):
            ref = full_forward_logprobs(eng.model, prompt, out.output_ids, 1.0)  # no inference mode: F.linear
            assert torch.allclose(torch.tensor(out.logprobs), ref, atol=1e-5), prompt
        # the kernel served the decode steps of at most `rows` rows and nothing larger (7 prompts: prefills are wider)
        assert calls and all(shape.numel() <= rows for shape in calls)
        assert rows == 4 or any(shape.numel() == len(PROMPTS) for shape in calls)  # 7 rows: two tiles
        got, want = eng.generate(PROMPTS[:3], GREEDY), plain.generate(PROMPTS[:3], GREEDY)
        assert [o.output_ids for o in got] == [o.output_ids for o in want]
    finally:
        eng.close()
        plain.close()


@needs_kernel
def test_training_through_a_patched_model_keeps_autograd(tiny_path):
    model = load_model(tiny_path, dtype="float32")
    assert skinny.install(model, 8) > 0
    head = model.get_output_embeddings()
    x = torch.randn(2, head.in_features, requires_grad=True)
    y = head(x)  # outside inference mode: F.linear, differentiable
    assert y.grad_fn is not None and torch.equal(y, F.linear(x, head.weight))
    y.sum().backward()
    assert head.weight.grad is not None
    with torch.inference_mode():
        assert torch.allclose(head(x.detach()), y.detach(), atol=1e-5)


@needs_kernel
def test_the_row_limit_follows_the_measurement_and_is_measured_once(tmp_path, monkeypatch):
    monkeypatch.setattr(hardware, "cache_dir", lambda: tmp_path)
    calls = []

    def fake(speedups, agree=True):
        def measure():
            calls.append(1)
            return {"agree": agree} | {f"default_s_{m}": s for m, s in speedups.items()} | {
                f"kernel_s_{m}": 1.0 for m in speedups}
        return measure

    monkeypatch.setattr(skinny, "_measure", fake({64: 1.0, 48: 1.02, 32: 1.0, 24: 1.05, 16: 1.3, 8: 2.0}))
    assert skinny.measured_rows()[0] == 16
    assert skinny.measured_rows()[0] == 16 and len(calls) == 1  # cached
    monkeypatch.setattr(skinny, "_source_hash", lambda: "an edited kernel")
    assert skinny.measured_rows()[0] == 16 and len(calls) == 2  # a changed kernel source is measured anew
    every = skinny._CANDIDATES
    no_gain, disagree = (dict.fromkeys(every, 1.0), True, 0), (dict.fromkeys(every, 2), False, 0)
    for speedups, agree, want in (no_gain, disagree):
        (tmp_path / "hardware.json").unlink()
        monkeypatch.setattr(skinny, "_measure", fake(speedups, agree))
        assert skinny.measured_rows()[0] == want


@needs_kernel
def test_a_patched_model_can_still_be_deep_copied(tiny_path):
    """The trainer copies a model for its reference policy: a patched engine model must survive that."""
    import copy

    model = load_model(tiny_path, dtype="float32")
    assert skinny.install(model, 8) > 0
    twin = copy.deepcopy(model)
    ids = torch.tensor([[5, 6, 7]])
    with torch.inference_mode():
        assert torch.allclose(twin(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5)
