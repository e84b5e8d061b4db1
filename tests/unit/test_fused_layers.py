"""relayrl.models.fused: the one-pass RMSNorm and SwiGLU kernels give PyTorch's outputs and gradients (to float
rounding), a model trained through them gets autograd's gradients, and everything they do not take (bf16, float64)
runs through the modules' own forwards."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from relayrl.models import fused, load_model, tiny_model

pytestmark = pytest.mark.skipif(fused.load_kernel() is None, reason="the norm/SwiGLU C kernel did not build here")


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-5) -> None:
    """|got - want| < tol x max(1, max|want|). Why 1e-5 holds on every target (tests/unit/test_kernel_targets.py):
    fp32's unit roundoff is u = 6e-8. The norm's row sums (d <= 576) are reordered by vector width, ~sqrt(d) u
    typical and d u = 3.4e-5 at worst against the same sum in PyTorch's order; its 1/sqrt is correctly rounded on
    both sides. SwiGLU's exp is libmvec's (<= 1 ulp in each ISA's variant) against PyTorch's (<= 1 ulp), so s
    differs by a few u; its gradient's g * (1 - s) magnifies that by |g| only while s < 1 in fp32, i.e. |g| < 17,
    to ~17 x 4 u = 4e-6. A reciprocal estimate (what -ffast-math allowed) put 1 - s at 6e-8 where it is 0 and
    failed this at 2e-4."""
    scale = want.abs().max().clamp(min=1.0)
    assert (got - want).abs().max() / scale < tol, (got - want).abs().max()


@pytest.mark.parametrize("shape", [(3, 37, 64), (5, 70), (1, 1, 576)])
def test_rms_norm_forward_and_backward_equal_the_formula(shape):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(*shape, generator=g) * 3).requires_grad_()
    w = (torch.randn(shape[-1], generator=g) + 1).requires_grad_()
    dy = torch.randn(*shape, generator=g)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y = fused.rms_norm(x, w, 1e-6)
    y.backward(dy)
    want = w2 * (x2 * torch.rsqrt(x2.pow(2).mean(-1, keepdim=True) + 1e-6))  # HF's LlamaRMSNorm in fp32
    want.backward(dy)
    _close(y, want)
    _close(x.grad, x2.grad)
    _close(w.grad, w2.grad)


@pytest.mark.parametrize("threads", [1, 2, 3])  # where the extremes fall, vector body or remainder, moves with them
def test_swiglu_forward_and_backward_equal_silu_times_up_even_where_exp_overflows(threads, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)  # what the kernel is handed
    g = torch.Generator().manual_seed(1)
    extremes = torch.tensor([-1e4, -100.0, -90.0, -89.0, -88.0, -80.0, -30.0, 0.0, 30.0, 89.0, 100.0, 1e4])
    gate = torch.cat([torch.randn(999, generator=g) * 4, extremes, torch.randn(5, generator=g), extremes])
    up = torch.randn(gate.shape, generator=g)
    dy = torch.randn(gate.shape, generator=g)
    a, b = gate.clone().requires_grad_(), up.clone().requires_grad_()
    a2, b2 = gate.clone().requires_grad_(), up.clone().requires_grad_()
    y = fused.swiglu(a, b)
    y.backward(dy)
    want = F.silu(a2) * b2
    want.backward(dy)
    for got, ref in ((y, want), (a.grad, a2.grad), (b.grad, b2.grad)):
        assert torch.isfinite(got).all()
        _close(got, ref)


def _loss_and_grads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits.float()
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_model_trained_through_the_kernels_gets_autograds_gradients(arch):
    path = tiny_model(arch)
    plain, patched = load_model(path, dtype="float32"), load_model(path, dtype="float32")
    layers = plain.config.num_hidden_layers
    assert fused.install(patched) == 3 * layers + 1  # two norms and an MLP per layer, and the final norm
    assert fused.install(patched) == 3 * layers + 1  # a second install keeps one patch per module
    layer = patched.model.layers[0]
    h = torch.randn(2, 5, plain.config.hidden_size, requires_grad=True)
    assert type(layer.input_layernorm(h).grad_fn).__name__ == "_RMSNormBackward"  # the kernels are in the graph
    assert "_SwiGLUBackward" in _graph_names(layer.mlp(h))
    ids = torch.randint(1, plain.config.vocab_size, (3, 13), generator=torch.Generator().manual_seed(2))
    want_loss, want = _loss_and_grads(plain, ids)
    got_loss, got = _loss_and_grads(patched, ids)
    _close(got_loss, want_loss)
    assert want.keys() == got.keys()
    for name in want:
        _close(got[name], want[name], 1e-4)


def _graph_names(t: torch.Tensor) -> set[str]:
    seen, todo = set(), [t.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or type(fn).__name__ in seen:
            continue
        seen.add(type(fn).__name__)
        todo.extend(f for f, _ in fn.next_functions)
    return seen


def test_what_the_kernels_do_not_take_runs_through_the_modules_own_forward():
    model = load_model(tiny_model("qwen2"), dtype="float32")
    fused.install(model)
    norm, mlp = model.model.norm, model.model.layers[0].mlp
    for dtype in (torch.bfloat16, torch.float64):
        norm.to(dtype), mlp.to(dtype)
        x = torch.randn(2, 3, model.config.hidden_size, dtype=dtype, requires_grad=True)
        assert norm(x).dtype == dtype and mlp(x).dtype == dtype
        assert "_RMSNormBackward" not in _graph_names(norm(x))
        assert "_SwiGLUBackward" not in _graph_names(mlp(x))


class _Subclass(torch.Tensor):  # stands in for a DTensor shard: its data_ptr is not the whole tensor's
    pass


def test_a_tensor_subclass_never_reaches_the_kernel():
    model = load_model(tiny_model("qwen2"), dtype="float32")
    fused.install(model)
    x = torch.randn(2, 3, model.config.hidden_size).as_subclass(_Subclass).requires_grad_()
    assert "_RMSNormBackward" not in _graph_names(model.model.norm(x))
    assert "_RMSNormBackward" in _graph_names(model.model.norm(torch.randn(2, 3, model.config.hidden_size,
                                                                           requires_grad=True)))
