"""The trainer's AdamW with bf16 moments: same updates as torch's AdamW within bf16 noise, 4 bytes of state per
parameter, an unbiased second moment (stochastic rounding), and a state that survives save/load as bf16; the C
kernel takes the same step as the PyTorch slices, whatever the thread count."""

import io
import logging
import shutil

import pytest
import torch

from relayrl.trainer import optim
from relayrl.trainer.optim import Bf16StateAdamW, adamw, round_to_bf16_, stochastic_round_

BF16_ULP = 2.0**-7  # bf16 keeps 8 significant bits: neighbours differ by at most this much relative
HAVE_CC = shutil.which("cc") is not None


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


@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "pytorch"])
def test_bf16_moments_follow_torch_adamw(use_kernel):
    kw = dict(lr=1e-2, betas=(0.9, 0.999), weight_decay=0.01)
    ref = fit(torch.optim.AdamW, foreach=False, **kw)
    ours = fit(Bf16StateAdamW, use_kernel=use_kernel, **kw)
    assert (ours - ref).abs().max() < 0.02 * ref.abs().max()
    # one step from zero state is exact: m = 0.1 g, v = 0.001 g^2 -> the update is -lr * sign(g) (up to eps)
    w = torch.nn.Parameter(torch.zeros(3))
    w.grad = torch.tensor([2.0, -0.5, 1e-3])
    Bf16StateAdamW([w], lr=0.1, use_kernel=use_kernel).step()
    torch.testing.assert_close(w.detach(), torch.tensor([-0.1, 0.1, -0.1]), atol=1e-5, rtol=0)


def one_step(use_kernel: bool, threads: int | None = None, steps_before: int = 6, dtype: torch.dtype = torch.float32):
    """A parameter (of `dtype`, its gradient too) with a mid-training state (moments of varied sign and scale),
    stepped once more; returns the weight, the state, the state and weight before, and the gradient."""
    g = torch.Generator().manual_seed(1)
    w = torch.nn.Parameter(torch.randn(3, 1000, generator=g).to(dtype))
    opt = Bf16StateAdamW([w], lr=1e-2, weight_decay=0.1, use_kernel=use_kernel)
    opt.state[w].update(step=torch.tensor(float(steps_before)),
                        exp_avg=(torch.randn(3, 1000, generator=g) * 0.1).bfloat16(),
                        exp_avg_sq=(torch.rand(3, 1000, generator=g) * 1e-2).bfloat16())
    w.grad = torch.randn(3, 1000, generator=g).to(dtype)
    before = {"w": w.detach().clone(), **{k: v.clone() for k, v in opt.state[w].items()}}
    previous = torch.get_num_threads()
    torch.set_num_threads(threads or previous)
    try:
        opt.step()
    finally:
        torch.set_num_threads(previous)
    return w.detach(), opt.state[w], before, w.grad


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the kernel cannot be built here")
def test_the_kernel_takes_the_pytorch_step():
    assert optim.load_kernel() is not None
    wk, sk, before, grad = one_step(use_kernel=True)
    wt, st, _, _ = one_step(use_kernel=False)
    # the first moment is rounded to nearest in both: equal up to one bf16 step where fp32 rounding differs
    torch.testing.assert_close(sk["exp_avg"].float(), st["exp_avg"].float(), rtol=BF16_ULP, atol=1e-12)
    # the second moment is rounded stochastically: each side lands on one of the two bf16 neighbours of the
    # same fp32 value
    v32 = before["exp_avg_sq"].float() * 0.999 + 0.001 * grad * grad
    for v in (sk["exp_avg_sq"], st["exp_avg_sq"]):
        assert ((v.float() - v32).abs() <= v32 * BF16_ULP).all()
    torch.testing.assert_close(wk, wt, rtol=1e-5, atol=1e-6)
    assert not torch.equal(sk["exp_avg_sq"], st["exp_avg_sq"])  # two code paths ran: their noise differs


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the kernel cannot be built here")
def test_the_kernel_takes_the_pytorch_step_on_bf16_weights():
    """bf16 weights and gradients (model.train_dtype=bfloat16): each side stores the same fp32 step's weight on
    one of its two bf16 neighbours, whatever the thread count (the kernel)."""
    (wk, sk, before, grad), (wt, st, _, _) = one_step(True, dtype=torch.bfloat16), one_step(False, dtype=torch.bfloat16)
    t, g = 7.0, grad.float()
    m = before["exp_avg"].float().lerp(g, 0.1)
    v = before["exp_avg_sq"].float() * 0.999 + 0.001 * g * g
    w32 = before["w"].float() * (1 - 1e-2 * 0.1) - 1e-2 / (1 - 0.9**t) * m / (v.sqrt() / (1 - 0.999**t) ** 0.5 + 1e-8)
    for w in (wk, wt):
        assert w.dtype == torch.bfloat16 and ((w.float() - w32).abs() <= w32.abs() * BF16_ULP).all()
    torch.testing.assert_close(sk["exp_avg"].float(), st["exp_avg"].float(), rtol=BF16_ULP, atol=1e-12)
    assert not torch.equal(wk, wt)  # two code paths ran: their noise differs
    one, two = one_step(True, threads=1, dtype=torch.bfloat16), one_step(True, threads=2, dtype=torch.bfloat16)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1]["exp_avg_sq"], two[1]["exp_avg_sq"])


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the kernel cannot be built here")
def test_the_kernel_step_is_the_same_on_any_thread_count():
    one, two = one_step(True, threads=1), one_step(True, threads=2)
    assert torch.equal(one[0], two[0])
    assert all(torch.equal(one[1][k], two[1][k]) for k in ("exp_avg", "exp_avg_sq"))


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the kernel cannot be built here")
def test_the_kernel_second_moment_decays_unbiased():
    """Zero gradients: v <- 0.999 v every step. Rounded to nearest it would never move (checked below on the
    PyTorch helper); the kernel's stochastic rounding keeps its mean on 0.999^t."""
    w = torch.nn.Parameter(torch.zeros(100_000))
    opt = Bf16StateAdamW([w], lr=1e-3, use_kernel=True)
    assert opt.kernel is not None
    opt.state[w].update(step=torch.tensor(0.0), exp_avg=torch.zeros(100_000, dtype=torch.bfloat16),
                        exp_avg_sq=torch.ones(100_000, dtype=torch.bfloat16))
    w.grad = torch.zeros_like(w)
    for _ in range(500):
        opt.step()
    assert float(opt.state[w]["exp_avg_sq"].float().mean()) == pytest.approx(0.999**500, rel=0.01)
    assert torch.equal(w.detach(), torch.zeros_like(w))


def test_without_a_kernel_the_pytorch_step_runs(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("RELAYRL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    with caplog.at_level(logging.WARNING, logger="relayrl.common.cbuild"):
        assert optim.load_kernel.__wrapped__() is None
    assert "false failed on adamw_bf16.c" in caplog.text
    monkeypatch.setattr(optim, "load_kernel", lambda: None)
    ours = fit(Bf16StateAdamW, lr=1e-2)
    assert torch.isfinite(ours).all() and ours.abs().max() > 0


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


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "pytorch"])
def test_round_to_bf16_lands_on_a_neighbour_with_the_right_odds(kernel, monkeypatch):
    """Each element becomes one of its two bf16 neighbours, the upper one with probability (distance from the
    lower) / (bf16 step): the mean over elements of one value equals that value; the same seed rounds the same
    way on any thread count."""
    if kernel and optim.load_kernel() is None:
        pytest.skip("no C compiler: the kernel cannot be built here")
    if not kernel:
        monkeypatch.setattr(optim, "load_kernel", lambda: None)
    src = torch.full((200_000,), 1.0 + 0.3 * 2.0**-7)  # 30% of the way from 1.0 to the next bf16 value
    dst = torch.empty_like(src, dtype=torch.bfloat16)
    round_to_bf16_(dst, src, seed=5)
    assert set(dst.float().unique().tolist()) == {1.0, 1.0 + 2.0**-7}
    assert float(dst.float().mean()) == pytest.approx(float(src[0]), abs=2e-5)
    again = torch.empty_like(dst)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        round_to_bf16_(again, src, seed=5)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(again, dst)
    round_to_bf16_(again, src, seed=6)
    assert not torch.equal(again, dst)
    signed = torch.randn(10_000) * 10.0 ** torch.randint(-6, 3, (10_000,))  # both signs, many magnitudes
    out = torch.empty_like(signed, dtype=torch.bfloat16)
    round_to_bf16_(out, signed, seed=1)
    down = signed.to(torch.bfloat16).float()
    assert ((out.float() - signed).abs() <= signed.abs() * 2.0**-7).all()  # within one bf16 step
    assert ((out.float() == down) | (out.float().sign() == signed.sign())).all()
    with pytest.raises(ValueError, match="shape"):  # never a write past the end of dst in C
        round_to_bf16_(torch.empty(3, dtype=torch.bfloat16), torch.zeros(4), seed=0)
