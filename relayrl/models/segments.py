"""Attention over shared-prompt rows: a training row [prompt, response 1, ..., response G] without the dense mask.

In such a row (relayrl.trainer.packer) each response sees the prompt and itself only. SDPA with that mask computes
every query against every key of the row (rows x L^2 scores) and masks afterwards; a GRPO group's row of 8 responses
then spends most of its attention on scores it throws away, and attention is a sizeable part of a training step
at the README job's shapes (docs/benchmarks.md, "Shared-prompt rows without the dense mask"). Here the prompt attends
causally to itself, and each response attends to [its row's prompt, itself], responses of similar length batched
together: G x n x (P + n) scores instead of (P + G n)^2. The attention itself is plain matmuls with a hand-written
backward that recomputes the probabilities (`_MaskedAttention`); outputs and gradients equal SDPA with the dense mask up
to float rounding (tests/unit/test_segment_attention.py). On CPUs a C kernel (kernels/segment_attention.c) does the same
per (row, KV head) without gathers, padding or masks (`_SegmentKernel`); the PyTorch version above is its fallback (no
compiler, RELAYRL_KERNELS=0, GPU tensors, float64). The packer builds layouts without loading transformers.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from relayrl.common import cbuild

MAX_BUCKETS = 4  # attention calls per layer for the responses: fewer pads more, more costs per-call overhead
DENSE_RATIO = 0.8  # use the segments only where their scores are at most this share of the dense mask's


@dataclass
class Bucket:
    """Responses of similar length, each padded to the longest (`span`) and laid out [prompt keys, own keys]."""

    span: int
    q_index: torch.Tensor  # [n * span] flat (row * L + position) index of each query; pads repeat a real one
    kv_index: torch.Tensor  # [n * (P + span)] the row's first P positions, then the response's own positions
    mask: torch.Tensor  # [n, 1, span, P + span] bool: the row's real prompt keys, own keys up to the query


@dataclass
class SegmentLayout:
    """Where every query of a shared-prompt micro-batch finds its keys; built once per micro-batch on the CPU."""

    prompt_len: int  # P: the longest prompt of the micro-batch's rows
    buckets: list[Bucket]
    out_index: torch.Tensor  # [rows * L] each position's output in cat(prompt part, bucket parts)
    prompt_lens: torch.Tensor  # [rows] int64: each row's own prompt length (the C kernel's layout)
    spans: torch.Tensor  # [responses, 3] int64: (row, start, length) of every response

    def to(self, device: torch.device | str) -> SegmentLayout:
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        buckets = [Bucket(b.span, move(b.q_index), move(b.kv_index), move(b.mask)) for b in self.buckets]
        return SegmentLayout(self.prompt_len, buckets, move(self.out_index), move(self.prompt_lens), move(self.spans))


def _buckets(lengths: list[int], prompt_len: int) -> list[list[int]]:
    """Split response indices, longest first, into at most MAX_BUCKETS runs that minimise the scores computed
    (each run costs count x longest x (prompt_len + longest)): a small dynamic programme over the distinct lengths,
    since a cut between two equal lengths never helps."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    distinct = sorted(set(lengths), reverse=True)
    counts = [0] * (len(distinct) + 1)  # counts[j]: responses longer than distinct[j]
    for j, n in enumerate(distinct):
        counts[j + 1] = counts[j] + lengths.count(n)
    d = len(distinct)

    def cost(i: int, j: int) -> int:  # distinct lengths i..j-1 in one run, padded to distinct[i]
        return (counts[j] - counts[i]) * distinct[i] * (prompt_len + distinct[i])

    inf = float("inf")
    best = [[inf] * (d + 1) for _ in range(MAX_BUCKETS + 1)]  # best[k][j]: the first j lengths in k runs
    cut = [[0] * (d + 1) for _ in range(MAX_BUCKETS + 1)]
    best[0][0] = 0
    for k in range(1, MAX_BUCKETS + 1):
        for j in range(1, d + 1):
            for i in range(k - 1, j):
                c = best[k - 1][i] + cost(i, j)
                if c < best[k][j]:
                    best[k][j], cut[k][j] = c, i
    k = min(range(1, min(MAX_BUCKETS, d) + 1), key=lambda k: best[k][d])
    runs, j = [], d
    while k > 0:
        i = cut[k][j]
        runs.append(order[counts[i]:counts[j]])
        j, k = i, k - 1
    return runs[::-1]


def segment_layout(prompt_lens: list[int], responses: list[list[tuple[int, int]]], width: int) -> SegmentLayout | None:
    """The layout of rows [prompt, responses...] of `width` positions: prompt_lens[r] and the (start, length) of
    each response of row r. None where it would not save work over the dense mask (few, long responses)."""
    rows, pmax = len(prompt_lens), max(prompt_lens)
    segs = [(r, start, n) for r, resp in enumerate(responses) for start, n in resp if n > 0]
    if not segs:
        return None
    runs = _buckets([n for _, _, n in segs], pmax)
    seg_cost = rows * pmax * pmax // 2 + sum(len(run) * segs[run[0]][2] * (pmax + segs[run[0]][2]) for run in runs)
    if seg_cost > DENSE_RATIO * rows * width * width:
        return None
    out_index = torch.zeros(rows * width, dtype=torch.long)  # pads read output 0: unused, never attended to
    for r, p in enumerate(prompt_lens):
        out_index[r * width: r * width + p] = torch.arange(r * pmax, r * pmax + p)
    buckets, offset = [], rows * pmax
    for run in runs:
        span = segs[run[0]][2]
        q_index = torch.empty(len(run), span, dtype=torch.long)
        kv_index = torch.empty(len(run), pmax + span, dtype=torch.long)
        mask = torch.zeros(len(run), 1, span, pmax + span, dtype=torch.bool)
        causal = torch.ones(span, span, dtype=torch.bool).tril_()
        for k, s in enumerate(run):
            r, start, n = segs[s]
            own = torch.arange(r * width + start, r * width + start + n)
            q_index[k, :n], q_index[k, n:] = own, own[0]
            kv_index[k, :pmax] = torch.arange(r * width, r * width + pmax)
            kv_index[k, pmax:pmax + n], kv_index[k, pmax + n:] = own, own[0]
            mask[k, 0, :, :prompt_lens[r]] = True  # pad queries (t >= n) see the prompt only: finite, unused
            mask[k, 0, :n, pmax:pmax + n] = causal[:n, :n]
            out_index[own] = torch.arange(offset + k * span, offset + k * span + n)
        buckets.append(Bucket(span, q_index.view(-1), kv_index.view(-1), mask))
        offset += len(run) * span
    return SegmentLayout(pmax, buckets, out_index, torch.tensor(prompt_lens, dtype=torch.long),
                         torch.tensor(segs, dtype=torch.long).view(-1, 3))


class _MaskedAttention(torch.autograd.Function):
    """softmax(q k^T scale, masked) v, the probabilities recomputed in backward (as flash attention does), so that no
    [.., queries, keys] tensor is kept between forward and backward. Plain matmuls, because PyTorch's CPU flash
    kernel costs about as much per (batch, head) task as it saves at these small shapes: its backward over a
    bucket's many short rows took as long as over the dense rows (docs/benchmarks.md, "Shared-prompt rows without
    the dense mask").

    q [n, kv_heads, group * t, d] (the query heads sharing a key head stacked along the queries), k and v
    [n, kv_heads, keys, d], mask [n, 1, t, keys] bool with at least one key visible per query."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale, group):
        p = _probs(q, k, mask, scale, group)
        top = p.amax(-1, keepdim=True)
        p = p.sub_(top).exp_()
        total = p.sum(-1, keepdim=True)
        out = torch.matmul(p.div_(total).to(v.dtype), v)
        lse = total.log_().add_(top)  # what backward needs to rebuild the probabilities with one exp
        ctx.save_for_backward(q, k, v, mask, lse, out)
        ctx.scale, ctx.group = scale, group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, mask, lse, out = ctx.saved_tensors
        p = _probs(q, k, mask, ctx.scale, ctx.group).sub_(lse).exp_()
        dv = torch.matmul(p.to(v.dtype).transpose(-1, -2), dout)
        dp = _wide(torch.matmul(dout, v.transpose(-1, -2)))
        dp = dp.sub_((_wide(dout) * _wide(out)).sum(-1, keepdim=True))
        ds = p.mul_(dp).mul_(ctx.scale).to(q.dtype)
        return torch.matmul(ds, k), torch.matmul(ds.transpose(-1, -2), q), dv, None, None, None


def _wide(x: torch.Tensor) -> torch.Tensor:
    """x in float32 at least: softmax statistics of bf16 scores are kept in fp32, float64 stays float64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _probs(q, k, mask, scale, group) -> torch.Tensor:
    """The masked, scaled scores, fp32 or wider: -inf where the mask hides a key."""
    n, kv_heads, rows, keys = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    s = _wide(torch.matmul(q, k.transpose(-1, -2))).mul_(scale)
    s.view(n, kv_heads, group, rows // group, keys).masked_fill_(~mask[:, :, None], float("-inf"))
    return s


def _attend(query, key, value, mask, scaling) -> torch.Tensor:
    """query [n, H, t, D], key/value [n, KVH, keys, D], mask [n, 1, t, keys] -> [n, t, H, D]."""
    n, heads, t, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    q = query.reshape(n, kv_heads, group * t, dim)  # head h reads key head h // group, as transformers' repeat_kv
    out = _MaskedAttention.apply(q, key, value, mask, scaling or dim ** -0.5, group)
    return out.view(n, heads, t, dim).transpose(1, 2)


def segment_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: SegmentLayout,
                      scaling: float | None = None) -> torch.Tensor:
    """Attention of rows [prompt, responses...]: query [rows, H, L, D], key/value [rows, KVH, L, D] -> [rows, L,
    H, D] (transformers' layout after attention)."""
    if _kernel_can_take(query, key, value):
        return _SegmentKernel.apply(query, key, value, layout, scaling or query.shape[-1] ** -0.5)
    rows, heads, width, dim = query.shape
    kv_heads, pmax = key.shape[1], layout.prompt_len
    causal = torch.ones(pmax, pmax, dtype=torch.bool, device=query.device).tril_().expand(rows, 1, pmax, pmax)
    prompt = _attend(query[:, :, :pmax], key[:, :, :pmax], value[:, :, :pmax], causal, scaling)
    parts = [prompt.reshape(rows * pmax, heads, dim)]
    q = query.transpose(1, 2).reshape(rows * width, heads, dim)
    k = key.transpose(1, 2).reshape(rows * width, kv_heads, dim)
    v = value.transpose(1, 2).reshape(rows * width, kv_heads, dim)
    for b in layout.buckets:
        n = b.mask.shape[0]
        qb = q.index_select(0, b.q_index).view(n, b.span, heads, dim).transpose(1, 2)
        kb = k.index_select(0, b.kv_index).view(n, pmax + b.span, kv_heads, dim).transpose(1, 2)
        vb = v.index_select(0, b.kv_index).view(n, pmax + b.span, kv_heads, dim).transpose(1, 2)
        parts.append(_attend(qb, kb, vb, b.mask, scaling).reshape(n * b.span, heads, dim))
    return torch.cat(parts).index_select(0, layout.out_index).view(rows, width, heads, dim)


# ---- the C kernel (CPU) ------------------------------------------------------------------------------------
_SOURCE = Path(__file__).with_name("kernels") / "segment_attention.c"
_MAX_G, _MAX_D = 64, 1024  # query heads per KV head (its stack arrays) and head size the kernel takes (MAX_G, MAX_D)


def build(source: Path = _SOURCE, fallback: str = "the trainer uses the PyTorch version") -> ctypes.CDLL | None:
    """`source` (this kernel, or another version of its file: bench/kernels.py segment_attention) built by
    relayrl.common.cbuild and loaded; None (logged with `fallback`) when it cannot be built or is switched off."""
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    shape, rc = [i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, i64, ptr, f32], ctypes.c_int
    signatures = {"relayrl_segment_attention_fwd": ([*shape, ptr, ptr, ctypes.c_int], rc),
                  "relayrl_segment_attention_bwd": ([*shape, ptr, ptr, ptr, ptr, ptr, ptr, ctypes.c_int], rc)}
    return cbuild.load(source, signatures=signatures, fallback=fallback)


@functools.cache
def load_kernel() -> ctypes.CDLL | None:
    """The compiled kernel library, or None (logged once) when it cannot be built or kernels are switched off."""
    return build()


def _kernel_can_take(*tensors: torch.Tensor) -> bool:
    """CPU fp32/bf16 tensors with the kernel built: a device pointer must never reach C, and float64 (the exactness
    tests) stays in PyTorch."""
    heads, kv_heads, dim = tensors[0].shape[1], tensors[1].shape[1], tensors[0].shape[-1]
    return (all(t.device.type == "cpu" and t.dtype in (torch.float32, torch.bfloat16) for t in tensors)
            and heads % kv_heads == 0 and heads // kv_heads <= _MAX_G and dim <= _MAX_D and load_kernel() is not None)


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32).contiguous()


def _layout_args(q: torch.Tensor, k: torch.Tensor) -> tuple[int, ...]:
    """The kernel's leading shape arguments (R, L, KVH, G, D), the same for forward and backward."""
    rows, heads, width, dim = q.shape
    return rows, width, k.shape[1], heads // k.shape[1], dim


def _check(status: int) -> None:
    if status:  # _kernel_can_take keeps shapes inside the kernel's limits, so this is a failed allocation
        raise MemoryError(f"segment-attention kernel failed (status {status}): out of memory for its score buffers")


class _SegmentKernel(torch.autograd.Function):
    """segment_attention through kernels/segment_attention.c: fp32 inside, outputs and gradients in the inputs'
    dtypes; saves fp32 q, k, v, the output and one logsumexp per query for backward."""

    @staticmethod
    def forward(ctx, query, key, value, layout, scale):
        rows, heads, width, dim = query.shape
        q, k, v = _f32(query), _f32(key), _f32(value)
        out = torch.zeros(rows, width, heads, dim)  # padding positions stay zero
        lse = torch.zeros(rows, heads, width)
        prompt_lens, spans = layout.prompt_lens.contiguous(), layout.spans.contiguous()
        _check(load_kernel().relayrl_segment_attention_fwd(
            *_layout_args(q, k), q.data_ptr(), k.data_ptr(), v.data_ptr(), prompt_lens.data_ptr(), spans.shape[0],
            spans.data_ptr(), scale, out.data_ptr(), lse.data_ptr(), torch.get_num_threads()))
        ctx.save_for_backward(q, k, v, out, lse, prompt_lens, spans)
        ctx.scale, ctx.dtypes = scale, (query.dtype, key.dtype, value.dtype)
        return out.to(value.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, prompt_lens, spans = ctx.saved_tensors
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        dout = _f32(dout)
        _check(load_kernel().relayrl_segment_attention_bwd(
            *_layout_args(q, k), q.data_ptr(), k.data_ptr(), v.data_ptr(), prompt_lens.data_ptr(), spans.shape[0],
            spans.data_ptr(), ctx.scale, out.data_ptr(), lse.data_ptr(), dout.data_ptr(), dq.data_ptr(),
            dk.data_ptr(), dv.data_ptr(), torch.get_num_threads()))
        qd, kd, vd = ctx.dtypes
        return dq.to(qd), dk.to(kd), dv.to(vd), None, None
