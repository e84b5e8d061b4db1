"""The written-out decode step's C ops (relayrl.engine.direct, kernels/decode_ops.c and skinny_multi): each against
its PyTorch formula, and an engine that runs them against one that runs PyTorch's ops."""

import pytest
import torch
import torch.nn.functional as F
from device_checks import PROMPTS, full_forward_logprobs

from relayrl.engine import direct, skinny
from relayrl.engine.base import SamplingParams
from relayrl.engine.local import LocalEngine
from relayrl.models import load_model

needs_kernels = pytest.mark.skipif(direct.load_kernel() is None or skinny.load_kernel() is None,
                                   reason="no C compiler: the decode-step kernels did not build")


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 33, 64])  # the streaming loop, the tiled loop and its edges
@pytest.mark.parametrize("k", [13, 576])
def test_one_multi_call_gives_each_weight_what_its_own_call_gives(rows, k):
    torch.manual_seed(rows + k)
    lib = skinny.load_kernel()
    x = torch.randn(rows, k + 3)[:, 1:k + 1]  # strided rows, read in place
    weights = [torch.randn(n, k) for n in (101, 16, 48)]  # chunk edges inside, at and past a boundary
    got = skinny.skinny_multi(lib, x, weights)
    for y, w in zip(got, weights):
        assert torch.equal(y, skinny.skinny_linear(lib, x, w, None))  # bit for bit: the same tiles
        assert torch.allclose(y, F.linear(x, w), rtol=1e-5, atol=1e-5 * k**0.5)


@needs_kernels
def test_multi_refuses_what_c_must_not_read():
    lib = skinny.load_kernel()
    with pytest.raises(RuntimeError, match="up to 4"):
        skinny.skinny_multi(lib, torch.randn(2, 8), [torch.randn(4, 8)] * 5)
    with pytest.raises(RuntimeError, match="up to 4"):
        skinny.skinny_multi(lib, torch.randn(2, 8), [torch.randn(4, 9)])  # another width
    with pytest.raises(RuntimeError, match="up to 4"):
        skinny.skinny_multi(lib, torch.randn(2, 8), [torch.randn(8, 4).t()])  # not contiguous
    with pytest.raises(RuntimeError, match="1 to 64"):
        skinny.skinny_multi(lib, torch.randn(65, 8), [torch.randn(4, 8)])


@needs_kernels
@pytest.mark.parametrize("rows", [1, 16, 200])  # 200 x 576 runs in parallel
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_adds_in_place_and_normalises(rows, with_delta):
    torch.manual_seed(rows)
    h, delta, w = torch.randn(rows, 576), torch.randn(rows, 576), torch.randn(576)
    want_h = h + delta if with_delta else h.clone()
    want = F.rms_norm(want_h, (576,), w, 1e-5)
    out = torch.empty_like(h)
    direct.load_kernel().relayrl_add_rms_norm(rows, 576, h.data_ptr(), delta.data_ptr() if with_delta else None,
                                              w.data_ptr(), 1e-5, out.data_ptr(), 2)
    assert torch.allclose(h, want_h, atol=1e-6)
    # the row's sum of squares (576 terms) reordered: <= 576 u = 3.4e-5 relative at worst, ~sqrt(576) u = 1.4e-6
    # typical; 1/sqrt correctly rounded on both sides (no rsqrt estimate): 1e-5 holds on every target
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rope_rotates_each_half_of_every_query_and_key_head(rows):
    torch.manual_seed(rows)
    heads, kv_heads, dim = 9, 3, 64
    q, k = torch.randn(rows, heads * dim), torch.randn(rows, kv_heads * dim)
    angles = torch.rand(rows, dim // 2) * 6
    cos, sin = angles.cos(), angles.sin()

    def rotate_half(t: torch.Tensor, n: int) -> torch.Tensor:  # Hugging Face's form
        t = t.view(rows, n, dim)
        c, s = torch.cat((cos, cos), -1)[:, None], torch.cat((sin, sin), -1)[:, None]
        return (t * c + torch.cat((-t[..., dim // 2:], t[..., :dim // 2]), -1) * s).reshape(rows, -1)

    want_q, want_k = rotate_half(q, heads), rotate_half(k, kv_heads)
    direct.load_kernel().relayrl_rope_qk(rows, heads, kv_heads, dim, q.data_ptr(), q.stride(0), k.data_ptr(),
                                         k.stride(0), cos.data_ptr(), sin.data_ptr(), 2)
    assert torch.allclose(q, want_q, atol=1e-5) and torch.allclose(k, want_k, atol=1e-5)


def _engine(path: str, rows: int) -> LocalEngine:
    return LocalEngine(load_model(path, dtype="float32"), eos_token_ids=[], max_batch_size=8, skinny_rows=rows)


@needs_kernels
@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # q/k/v biases added after the multi call, and none
@pytest.mark.parametrize("rows", [0, 64])  # PyTorch's linears with the C norms and rotary; the multi calls too
def test_an_engine_on_the_c_ops_gives_the_plain_forwards_logprobs(arch, rows, monkeypatch):
    from relayrl.models import tiny_model

    path = str(tiny_model(arch))
    torch_step, multi = [], []
    plain, real = direct._decode_logits_torch, skinny.skinny_multi
    monkeypatch.setattr(direct, "_decode_logits_torch", lambda *a: torch_step.append(1) or plain(*a))
    monkeypatch.setattr(skinny, "skinny_multi", lambda *a: multi.append(1) or real(*a))
    eng = _engine(path, rows)
    try:
        assert eng.direct
        outs = eng.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True, seed=5))
        assert not torch_step and bool(multi) == (rows > 0)  # the C ops ran every step
        for prompt, out in zip(PROMPTS, outs):
            ref = full_forward_logprobs(eng.model, prompt, out.output_ids, 1.0)
            assert torch.allclose(torch.tensor(out.logprobs), ref, atol=1e-5), prompt
    finally:
        eng.close()


@needs_kernels
def test_with_the_c_ops_switched_off_the_step_runs_pytorchs_ops(tiny_path, monkeypatch):
    monkeypatch.setattr(direct, "load_kernel", lambda: None)  # RELAYRL_KERNELS_OFF=decode_ops, or no compiler
    torch_step = []
    plain = direct._decode_logits_torch
    monkeypatch.setattr(direct, "_decode_logits_torch", lambda *a: torch_step.append(1) or plain(*a))
    eng = _engine(tiny_path, 64)
    try:
        out = eng.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))
        assert eng.direct and torch_step and len(out[0].output_ids) == 4
    finally:
        eng.close()
