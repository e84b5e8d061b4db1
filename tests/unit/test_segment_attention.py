"""Shared-prompt attention without the dense mask (relayrl.models.segments): the same outputs and gradients as SDPA
with the packer's mask, fewer scores, and the trainer's forward really going through it."""

import copy
import random

import pytest
import torch
import torch.nn.functional as F
from engines_for_tests import rollout

from relayrl.models import attention as model_attention
from relayrl.models import load_model, segments
from relayrl.models.segments import _buckets, segment_attention, segment_layout
from relayrl.trainer.engine import TrainEngine
from relayrl.trainer.packer import Packer, _segment_mask


def _rows(seed: int, rows: int = 3, group: int = 5, max_prompt: int = 9, max_resp: int = 13):
    """Random shared-prompt rows: prompt lengths, (start, length) of every response, the packer's segment ids."""
    rng = random.Random(seed)
    prompt_lens, spans = [], []
    for _ in range(rows):
        p = rng.randint(1, max_prompt)
        lens = [rng.randint(1, max_resp) for _ in range(rng.randint(1, group))]
        starts = [p + sum(lens[:j]) for j in range(len(lens))]
        prompt_lens.append(p)
        spans.append(list(zip(starts, lens)))
    width = max(p + sum(n for _, n in sp) for p, sp in zip(prompt_lens, spans))
    segment = torch.full((rows, width), -1, dtype=torch.long)  # the packer's ids: -1 pad, 0 prompt, j response j
    for r, (p, sp) in enumerate(zip(prompt_lens, spans)):
        segment[r, :p] = 0
        for j, (start, n) in enumerate(sp, 1):
            segment[r, start:start + n] = j
    return prompt_lens, spans, segment, width


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_outputs_and_gradients_equal_sdpa_with_the_dense_mask(seed, heads, kv_heads, monkeypatch):
    monkeypatch.setattr(segments, "DENSE_RATIO", 100.0)  # always build the layout, even where dense is cheaper
    prompt_lens, spans, segment, width = _rows(seed)
    layout = segment_layout(prompt_lens, spans, width)
    g = torch.Generator().manual_seed(seed)
    rows, dim = len(prompt_lens), 8
    q = torch.randn(rows, heads, width, dim, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(rows, kv_heads, width, dim, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(rows, kv_heads, width, dim, dtype=torch.float64, generator=g, requires_grad=True)
    upstream = torch.randn(rows, width, heads, dim, dtype=torch.float64, generator=g) * (segment >= 0)[..., None, None]

    rep = heads // kv_heads
    dense = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                           attn_mask=_segment_mask(segment), scale=0.3).transpose(1, 2)
    got = segment_attention(q, k, v, layout, scaling=0.3)
    real = segment >= 0
    assert got.shape == dense.shape
    assert torch.allclose(got[real], dense[real], atol=1e-12)
    want_grads = torch.autograd.grad((dense * upstream).sum(), (q, k, v))
    got_grads = torch.autograd.grad((got * upstream).sum(), (q, k, v))
    for name, a, b in zip("qkv", got_grads, want_grads):
        assert torch.allclose(a, b, atol=1e-12), name


def test_buckets_cover_every_response_once_and_pad_less_than_one_bucket():
    lengths = [64, 7, 60, 9, 12, 64, 5, 30]
    runs = _buckets(lengths, prompt_len=40)
    assert sorted(i for run in runs for i in run) == list(range(len(lengths)))
    assert 1 < len(runs) <= segments.MAX_BUCKETS

    def cost(runs):
        return sum(len(run) * max(lengths[i] for i in run) * (40 + max(lengths[i] for i in run)) for run in runs)

    assert cost(runs) < 0.6 * cost([list(range(len(lengths)))])


@pytest.mark.parametrize("seed", range(20))
def test_buckets_are_the_cheapest_split_into_runs_of_sorted_lengths(seed):
    import itertools

    rng = random.Random(seed)
    lengths = [rng.randint(1, 30) for _ in range(rng.randint(1, 9))]

    def cost(runs):
        return sum(len(run) * max(lengths[i] for i in run) * (5 + max(lengths[i] for i in run)) for run in runs)

    ranked = sorted(lengths, reverse=True)
    best = min(sum(len(r) * r[0] * (5 + r[0]) for r in (ranked[a:b] for a, b in zip((0, *cuts), (*cuts, len(ranked)))))
               for k in range(segments.MAX_BUCKETS) for cuts in itertools.combinations(range(1, len(ranked)), k))
    assert cost(_buckets(lengths, prompt_len=5)) == best


def test_layout_only_where_it_saves_work():
    # a GRPO group in one row: 8 responses of ~40 tokens after a 45-token prompt (the README job's shapes)
    group = [(45 + 40 * j, 40) for j in range(8)]
    layout = segment_layout([45], [group], 45 + 320)
    assert layout is not None
    scores = 45 * 45 // 2 + sum(b.mask.shape[0] * b.mask.shape[2] * b.mask.shape[3] for b in layout.buckets)
    assert scores < 0.25 * 365 * 365  # ~4x fewer scores than the dense mask's
    # one long response after a short prompt: the dense mask is about as cheap, so none is built
    assert segment_layout([10], [[(10, 100)]], 110) is None


@pytest.fixture(scope="module")
def model(tiny_path):
    return load_model(tiny_path)


@pytest.mark.parametrize("autocast", [False, True])
def test_trainer_forward_goes_through_segments_with_the_same_logprobs_and_gradients(model, monkeypatch, autocast):
    """fp32: equal to float rounding; bf16 autocast (the trainer's setting where bf16 is native): equal to bf16's
    rounding, and the backward's dtypes hold together."""
    samples = rollout(model, group=4)
    mb = Packer(10_000, pad_id=0, share_prompt=True).pack(samples).micro_batches[0]
    assert mb.layout is not None
    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        return segment_attention(*args, **kwargs)

    monkeypatch.setattr(model_attention, "segment_attention", counting)
    results = []
    for use in (True, False):
        engine = TrainEngine(copy.deepcopy(model), autocast_bf16=autocast)
        assert engine.segments  # the tiny model runs SDPA: relayrl's attention is installed
        engine.segments = use
        engine.model.zero_grad(set_to_none=True)
        logp, _ = engine.logprobs(mb)
        logp.sum().backward()
        results.append((logp.detach(), [p.grad for p in engine.model.parameters()]))
        assert len(calls) == (model.config.num_hidden_layers if use else 0)
        calls.clear()
    (lp_seg, g_seg), (lp_dense, g_dense) = results
    if not autocast:
        assert torch.allclose(lp_seg, lp_dense, atol=1e-5)
        for a, b in zip(g_seg, g_dense):
            assert torch.allclose(a, b, atol=1e-5)
        return
    assert (lp_seg - lp_dense).abs().max() < 0.05
    flat = [torch.cat([g.flatten() for g in gs]) for gs in (g_seg, g_dense)]
    assert F.cosine_similarity(*flat, dim=0) > 0.999


# ---- the C kernel ----------------------------------------------------------------------------------------------
needs_kernel = pytest.mark.skipif(segments.load_kernel() is None, reason="segment-attention C kernel not built "
                                  "here (no C compiler, or RELAYRL_KERNELS=0)")


def _qkv(seed, rows, width, heads, kv_heads, dim, dtype):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, h, width, dim, generator=g) * 2).to(dtype).requires_grad_()
            for h in (heads, kv_heads, kv_heads)]


@needs_kernel
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (9, 3)])
# the kernel's generic head size, and its D = 64 / 128 bodies (vector registers at 64) over prompts and responses
# longer than its blocks of 8 queries and 16 keys, so blocks, their edges and the two parts of a row all occur
@pytest.mark.parametrize("dim,max_prompt,max_resp", [(16, 9, 13), (64, 40, 50), (128, 20, 30)])
def test_kernel_equals_the_pytorch_version_outputs_and_gradients(seed, heads, kv_heads, dim, max_prompt, max_resp,
                                                                  monkeypatch):
    monkeypatch.setattr(segments, "DENSE_RATIO", 100.0)
    prompt_lens, spans, segment, width = _rows(seed, max_prompt=max_prompt, max_resp=max_resp)
    layout = segment_layout(prompt_lens, spans, width)
    q, k, v = _qkv(seed, len(prompt_lens), width, heads, kv_heads, dim, torch.float32)
    upstream = torch.randn(len(prompt_lens), width, heads, dim) * (segment >= 0)[..., None, None]
    got = segment_attention(q, k, v, layout, scaling=0.3)
    assert type(got.grad_fn).__name__ == "_SegmentKernelBackward"  # the kernel ran, not the fallback
    got_grads = torch.autograd.grad((got * upstream).sum(), (q, k, v))
    monkeypatch.setattr(segments, "_kernel_can_take", lambda *t: False)
    want = segment_attention(q, k, v, layout, scaling=0.3)
    want_grads = torch.autograd.grad((want * upstream).sum(), (q, k, v))
    real = segment >= 0
    wider = dim / 16  # longer dot products round more (both sides are fp32): measured 2e-5 / 2e-4 at 64 and 128
    assert torch.allclose(got[real], want[real], atol=1e-5 * wider)
    assert not got[~real].any()  # padding positions attend to nothing: zeros
    for name, a, b in zip("qkv", got_grads, want_grads):
        assert torch.allclose(a, b, atol=1e-4 * wider), name


@needs_kernel
def test_kernel_keeps_the_autocast_dtypes():
    """Under bf16 autocast transformers hands fp32 queries and keys (after the rotary embedding) and bf16 values;
    the output comes back in the values' dtype and every gradient in its input's dtype."""
    prompt_lens, spans, segment, width = _rows(1)
    layout = segment_layout(prompt_lens, spans, width) or pytest.skip("layout not built for this draw")
    q, k, _ = _qkv(1, len(prompt_lens), width, 6, 2, 16, torch.float32)
    v = _qkv(2, len(prompt_lens), width, 6, 2, 16, torch.bfloat16)[2]
    out = segment_attention(q, k, v, layout)
    assert out.dtype == torch.bfloat16
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    assert [g.dtype for g in grads] == [torch.float32, torch.float32, torch.bfloat16]
    assert all(torch.isfinite(g.float()).all() for g in grads)


def test_without_the_kernel_the_pytorch_version_runs(monkeypatch):
    monkeypatch.setattr(segments, "_kernel_can_take", lambda *t: False)
    monkeypatch.setattr(segments, "DENSE_RATIO", 100.0)
    prompt_lens, spans, _, width = _rows(0)
    q, k, v = _qkv(0, len(prompt_lens), width, 4, 2, 8, torch.float32)
    out = segment_attention(q, k, v, segment_layout(prompt_lens, spans, width))
    assert type(out.grad_fn).__name__ != "_SegmentKernelBackward"


def test_trainers_use_segments_on_cpus_and_the_dense_mask_on_gpus(model):
    """On a GPU SDPA's fused kernels with the dense mask beat the segments' PyTorch version (models.attention)."""
    assert model_attention.segments_pay_off(torch.device("cpu"))
    assert not model_attention.segments_pay_off(torch.device("cuda"))
    assert TrainEngine(copy.deepcopy(model)).segments
