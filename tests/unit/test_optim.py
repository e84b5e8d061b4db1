"""The trainer's AdamW with bf16 moments: same updates as torch's AdamW within bf16 noise, 4 bytes of state per
parameter, an unbiased second moment (stochastic rounding), and a state that survives save/load as bf16."""

import io

import pytest
import torch

from relayrl.trainer.optim import Bf16StateAdamW, adamw, stochastic_round_


def regression(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x, w_true = torch.randn(256, 64, generator=g), torch.randn(64, 8, generator=g)
    return x, x @ w_true


def fit(opt_cls, steps: int = 200, **kw) -> torch.Tensor:
    x, y = regression()
    w = torch.nn.Parameter(torch.zeros(64, 8))
    opt = opt_cls([w], **kw)
    for _ in range(steps):
        opt.zero_grad()
        ((x @ w - y) ** 2).mean().backward()
        opt.step()
    return w.detach()


def test_bf16_moments_follow_torch_adamw():
    kw = dict(lr=1e-2, betas=(0.9, 0.999), weight_decay=0.01)
    ref = fit(torch.optim.AdamW, foreach=False, **kw)
    ours = fit(Bf16StateAdamW, **kw)
    assert (ours - ref).abs().max() < 0.02 * ref.abs().max()
    # one step from zero state is exact: m = 0.1 g, v = 0.001 g^2 -> the update is -lr * sign(g) (up to eps)
    w = torch.nn.Parameter(torch.zeros(3))
    w.grad = torch.tensor([2.0, -0.5, 1e-3])
    Bf16StateAdamW([w], lr=0.1).step()
    torch.testing.assert_close(w.detach(), torch.tensor([-0.1, 0.1, -0.1]), atol=1e-5, rtol=0)


def test_state_is_bf16_and_half_of_fused_adamw():
    w = torch.nn.Parameter(torch.zeros(1000, 10))
    w.grad = torch.ones_like(w)
    ours, fused = adamw([w], state_dtype="bfloat16", lr=1e-3), adamw([w], lr=1e-3)
    ours.step()
    fused.step()
    nbytes = lambda o: sum(t.numel() * t.element_size() for t in o.state[w].values() if t.dim())  # noqa: E731
    assert {o.state[w]["exp_avg_sq"].dtype for o in (ours,)} == {torch.bfloat16}
    assert nbytes(ours) == 4 * w.numel() and nbytes(fused) == 8 * w.numel()
    with pytest.raises(ValueError, match="optimizer_state_dtype"):
        adamw([w], state_dtype="float16")


def test_stochastic_rounding_is_unbiased_where_rounding_to_nearest_sticks():
    v32 = torch.full((100_000,), 1.0)
    v_sr = v32.to(torch.bfloat16)
    v_rn = v32.to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    for _ in range(500):  # AdamW's second moment with zero gradients: v <- 0.999 v
        stochastic_round_(v_sr, v_sr.float() * 0.999, gen)
        v_rn.copy_(v_rn.float() * 0.999)
    assert float(v_rn.float().mean()) == 1.0  # round to nearest: 0.999 * v rounds back to v, v never decays
    assert float(v_sr.float().mean()) == pytest.approx(0.999**500, rel=0.01)


def test_save_and_load_keep_bf16_moments_and_continue_identically():
    x, y = regression()

    def make():
        w = torch.nn.Parameter(torch.zeros(64, 8))
        return w, Bf16StateAdamW([w], lr=1e-2)

    def step(w, opt):
        opt.zero_grad()
        ((x @ w - y) ** 2).mean().backward()
        opt.step()

    w, opt = make()
    for _ in range(3):
        step(w, opt)
    buf = io.BytesIO()
    torch.save({"w": w.detach().clone(), "opt": opt.state_dict()}, buf)
    step(w, opt)
    buf.seek(0)
    saved = torch.load(buf)
    w2, opt2 = make()
    with torch.no_grad():
        w2.copy_(saved["w"])
    opt2.load_state_dict(saved["opt"])  # torch would cast the moments to the parameter's fp32
    assert opt2.state[w2]["exp_avg"].dtype == torch.bfloat16 == opt2.state[w2]["exp_avg_sq"].dtype
    step(w2, opt2)
    assert torch.equal(w2, w)
