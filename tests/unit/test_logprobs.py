"""Chunked LM-head log-probabilities: equal to the plain [tokens x vocab] computation, values and gradients."""

import contextlib
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from relayrl.models import load_model
from relayrl.sample import Sample
from relayrl.trainer.engine import TrainEngine
from relayrl.trainer.logprobs import FORWARD_ROWS, token_logprobs, weight_grad_into_param
from relayrl.trainer.packer import Packer


def _plain(hidden, weight, targets, temperature, with_entropy):
    logits = (hidden @ weight.t()).float() / temperature
    lsm = torch.log_softmax(logits, dim=-1)
    logp = lsm.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(lsm.exp() * lsm).sum(-1) if with_entropy else None
    return logp, entropy


def _inputs(n=37, h=16, v=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64).float().requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.5).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, targets


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_values_and_gradients_match_the_plain_computation(temperature, entropy_grad):
    hidden, weight, targets = _inputs()
    g = torch.Generator().manual_seed(1)
    w_lp, w_h = torch.randn(len(targets), generator=g), torch.randn(len(targets), generator=g)
    # 8 rows' worth of logits per block: 37 rows walk 5 blocks of 64 columns, the last one short
    logp, ent = token_logprobs(hidden, weight, targets, temperature=temperature, with_entropy=True,
                               entropy_grad=entropy_grad, chunk_bytes=8 * 4 * 300)
    loss = (logp * w_lp).sum() + ((ent * w_h).sum() if entropy_grad else 0.0)
    gh, gw = torch.autograd.grad(loss, [hidden, weight])

    ref_lp, ref_h = _plain(hidden, weight, targets, temperature, True)
    ref_loss = (ref_lp * w_lp).sum() + ((ref_h * w_h).sum() if entropy_grad else 0.0)
    rh, rw = torch.autograd.grad(ref_loss, [hidden, weight])
    assert (logp - ref_lp).abs().max() < 1e-5
    assert (ent - ref_h).abs().max() < 1e-5
    assert torch.allclose(gh, rh, rtol=1e-5, atol=1e-5)  # sums over the chunks' rows: float rounding only
    assert torch.allclose(gw, rw, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_rows_beyond_one_pass_and_large_logits_match_the_plain_computation(with_entropy):
    """More rows than one pass over the vocabulary takes (FORWARD_ROWS) and logits whose row maximum moves from
    block to block (scaled up, the largest near the end): the online logsumexp is exact to float rounding."""
    n = FORWARD_ROWS + 37
    hidden, weight, targets = _inputs(n=n, h=16, v=3000)
    with torch.no_grad():
        weight[-100:] *= 6  # the last blocks hold most rows' maximum
    logp, ent = token_logprobs(hidden, weight, targets, with_entropy=with_entropy, chunk_bytes=50 * 4 * 3000)
    ref_lp, ref_h = _plain(hidden, weight, targets, 1.0, with_entropy)
    assert (logp - ref_lp).abs().max() < 1e-5
    if with_entropy:
        assert (ent - ref_h).abs().max() < 1e-5


def test_entropy_carries_no_gradient_unless_asked():
    hidden, weight, targets = _inputs()
    logp, ent = token_logprobs(hidden, weight, targets, with_entropy=True)
    assert logp.requires_grad and not ent.requires_grad
    assert token_logprobs(hidden, weight, targets)[1] is None


def test_no_grad_path_matches_and_keeps_no_graph():
    hidden, weight, targets = _inputs()
    with torch.no_grad():
        logp, ent = token_logprobs(hidden, weight, targets, with_entropy=True, chunk_bytes=1)  # one row a chunk
    ref_lp, ref_h = _plain(hidden.detach(), weight.detach(), targets, 1.0, True)
    assert not logp.requires_grad
    assert torch.allclose(logp, ref_lp, atol=1e-5) and torch.allclose(ent, ref_h, atol=1e-5)


def test_bf16_autocast_matches_the_plain_autocast_computation():
    hidden, weight, targets = _inputs(n=64, h=32, v=500)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, _ = token_logprobs(hidden, weight, targets, chunk_bytes=16 * 4 * 500)
        ref, _ = _plain(hidden, weight, targets, 1.0, False)
    gh, gw = torch.autograd.grad(logp.sum(), [hidden, weight])
    rh, rw = torch.autograd.grad(ref.sum(), [hidden, weight])
    assert gw.dtype == torch.float32 and gh.dtype == torch.float32
    assert (logp - ref).abs().max() < 1e-3  # same bf16 matmul; fp32 softmax on both sides
    assert (gh - rh).abs().max() < 2e-2 and (gw - rw).abs().max() < 2e-2


class _PeakBytes(TorchDispatchMode):
    """Peak bytes of the storages that ops create while the mode is on and that are still alive (CPU torch has
    no allocator statistics; this counts what the code asks for, which is what the chunking controls)."""

    def __init__(self, dtype: torch.dtype | None = None):
        super().__init__()
        self.live, self.peak, self._seen, self.sizes, self.dtype = 0, 0, set(), [], dtype

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}  # views and in-place results are not new memory
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or self.dtype not in (None, t.dtype):
                continue
            if (key := t.untyped_storage().data_ptr()) not in self._seen | inputs:
                self._seen.add(key)
                self.live += t.untyped_storage().nbytes()
                self.sizes.append(t.untyped_storage().nbytes())
                weakref.finalize(t, self._free, key, t.untyped_storage().nbytes())
        self.peak = max(self.peak, self.live)
        return out

    def _free(self, key, nbytes):
        self._seen.discard(key)
        self.live -= nbytes


@pytest.mark.parametrize("entropy_grad,blocks", [(False, 1), (True, 2)])
def test_head_working_memory_is_one_block_or_two_with_the_entropy_gradient(entropy_grad, blocks):
    """Backward's working memory beyond the two gradients is one block of recomputed logits (two when the
    entropy is differentiated), not the three (logits, softmax, gradient) a plain formula keeps."""
    n, h, v = 64, 8, 4096
    hidden, weight, targets = _inputs(n=n, h=h, v=v)
    block = 128 * 1024  # chunk_bytes: 8 rows x 4096 in forward, 64 rows x 512 columns in backward
    logp, ent = token_logprobs(hidden, weight, targets, with_entropy=True, entropy_grad=entropy_grad,
                               chunk_bytes=block)
    loss = logp.sum() + (ent.sum() if entropy_grad else 0.0)
    with _PeakBytes() as mode:
        gh, gw = torch.autograd.grad(loss, [hidden, weight])
    grads = gh.nbytes + gw.nbytes
    assert mode.peak - grads <= blocks * block + block // 4, (mode.peak - grads) / block
    for with_entropy, chunks in [(False, 1), (True, 2)]:  # forward: the logits, and p * lp for the entropy
        with torch.no_grad(), _PeakBytes() as mode:
            token_logprobs(hidden, weight, targets, with_entropy=with_entropy, chunk_bytes=block)
        assert mode.peak <= chunks * block + block // 4, (with_entropy, mode.peak / block)


def _tied_loss(weight, ids, targets, block):
    """A tied head: the weight embeds the inputs (reached last in backward) and scores the outputs."""
    hidden = torch.nn.functional.embedding(ids, weight) * 1.5
    logp, _ = token_logprobs(hidden, weight, targets, chunk_bytes=block)
    return -logp.sum()


def test_inside_the_context_backward_writes_the_head_gradient_into_the_parameter():
    """Same .grad as autograd's own accumulation (from None, then accumulating, with a tied embedding use and
    with a gradient hook that must keep autograd's path), and no [vocab x hidden] buffer beside .grad."""
    _, w0, targets = _inputs(n=64, h=64, v=4096)
    ids = torch.randint(0, 4096, (64,), generator=torch.Generator().manual_seed(3))
    block = 128 * 1024
    grads = []
    for into in (False, True):
        weight = torch.nn.Parameter(w0.detach().clone())
        for _ in range(2):
            with weight_grad_into_param() if into else contextlib.nullcontext():
                loss = _tied_loss(weight, ids, targets, block)
            loss.backward()
        grads.append(weight.grad)
    assert torch.allclose(grads[0], grads[1], rtol=1e-5, atol=1e-6)

    hooked = torch.nn.Parameter(w0.detach().clone())
    hooked.register_hook(lambda g: 2 * g)
    with weight_grad_into_param():
        loss = _tied_loss(hooked, ids, targets, block)
    loss.backward()
    assert torch.allclose(hooked.grad, grads[0], rtol=1e-5, atol=1e-6)  # 2 x (the sum of two backwards)

    hidden, weight, targets = _inputs(n=64, h=16, v=16384)  # untied: only the head's gradient, .grad there
    weight = torch.nn.Parameter(weight.detach())
    weight.grad = torch.zeros_like(weight)  # 8 blocks
    for into, most in ((True, 1.5 * block), (False, 8 * block)):  # a block of logits + its [cols x h] product
        with weight_grad_into_param() if into else contextlib.nullcontext():
            logp, _ = token_logprobs(hidden, weight, targets, chunk_bytes=block)
        with _PeakBytes() as mode:
            logp.sum().backward()
        extra = mode.peak - hidden.grad.nbytes  # beyond the hidden states' gradient
        assert (extra <= most) if into else (extra >= most), (into, extra / block)
        hidden.grad = None


def _one_sample_micro_batch():
    """A 3-token prompt and 4 generated tokens, packed as the trainer packs them."""
    sample = Sample(prompt_ids=[5, 6, 7])
    sample.append_generated([8, 9, 10, 11], [0.0] * 4, [0] * 4, "stop")
    return Packer(4096, pad_id=0).pack([sample]).micro_batches[0]


def test_the_train_engine_writes_the_tied_head_gradient_in_place(tiny_path):
    """In a micro-step's backward the head adds its part into .grad instead of holding a whole [vocab x hidden]
    gradient in autograd's buffer through every layer's backward, to be summed with the embedding's."""
    engine = TrainEngine(load_model(tiny_path, dtype="float32"))
    mb = _one_sample_micro_batch()
    weight = engine.model.get_output_embeddings().weight
    assert weight is engine.model.get_input_embeddings().weight

    def loss_fn(mb, logp, entropy):
        return -logp.sum(), {}

    with engine.training_mode():
        engine._micro_step(mb, loss_fn, False, False)  # .grad now exists
        first = weight.grad.clone()
        with _PeakBytes() as mode:
            engine._micro_step(mb, loss_fn, False, False)
    assert torch.allclose(weight.grad, 2 * first, rtol=1e-5, atol=1e-6)
    # only the head's block product (the tiny vocabulary is one block): no buffer for the head's whole gradient,
    # no dense embedding gradient (relayrl.trainer.embedding adds its rows into .grad), no sum of the two
    assert mode.sizes.count(weight.nbytes) == 1, mode.sizes.count(weight.nbytes)


def test_the_trainers_autocast_keeps_no_bf16_copy_of_the_whole_model(tiny_path):
    """Under bf16 autocast with gradient checkpointing, a forward's bf16 weights live one use at a time; autocast's
    weight cache would keep every cast until the forward ends: a bf16 copy of the model on top of its peak."""
    engine = TrainEngine(load_model(tiny_path, dtype="float32"), autocast_bf16=True, gradient_checkpointing=True)
    mb = _one_sample_micro_batch()
    weights = [m.weight for m in engine.model.modules() if isinstance(m, torch.nn.Linear)]
    with engine.training_mode(), _PeakBytes(torch.bfloat16) as mode:
        logp, _ = engine.logprobs(mb)
    logp.sum().backward()  # the step still trains: every linear weight gets a gradient
    assert all(w.grad is not None for w in weights)
    model_bf16 = sum(w.numel() * 2 for w in weights)
    assert mode.peak < model_bf16 / 2, (mode.peak, model_bf16)  # with the cache: >= model_bf16


def test_train_engine_logprobs_equal_the_unchunked_lm_head(tiny_path):
    """The engine's logprobs (trainer, old-policy and reference passes) against model(...).logits."""
    model = load_model(tiny_path, dtype="float32")
    engine = TrainEngine(model, temperature=0.8)
    samples = [Sample(prompt_ids=[5, 6, 7]), Sample(prompt_ids=[5, 6])]
    samples[0].append_generated([8, 9, 10, 11], [0.0] * 4, [0] * 4, "stop")
    samples[1].append_generated([12, 13], [0.0] * 2, [0] * 2, "stop")
    mb = Packer(4096, pad_id=0).pack(samples).micro_batches[0]
    logp, _ = engine.logprobs(mb)
    with torch.no_grad():
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                       position_ids=mb.position_ids).logits[mb.rows, mb.cols].float() / 0.8
    ref = torch.log_softmax(logits, -1).gather(-1, mb.targets[:, None]).squeeze(-1)
    assert (logp.detach() - ref).abs().max() < 1e-5
    assert (engine.forward_logprobs(mb) - ref).abs().max() < 1e-5


def test_under_autocast_the_forward_casts_the_head_weight_once():
    """Autocast would cast the fp32 [vocab x hidden] weight again for every chunk's matmul; the head casts it once."""
    hidden, weight, targets = _inputs(n=64, h=32, v=500)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False), _PeakBytes() as mode:
        token_logprobs(hidden, weight, targets, with_entropy=True, chunk_bytes=8 * 4 * 500)  # 8 chunks
    assert mode.sizes.count(weight.numel() * 2) == 1
