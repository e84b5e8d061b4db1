#!/usr/bin/env python
"""The trainer's one-pass RMSNorm and SwiGLU (relayrl/models/kernels/norm_swiglu.c) against PyTorch's ops, and the
LM head's vocabulary blocks (relayrl.trainer.logprobs) cache-sized against the chunk budget's: time and memory.

Why: both change what a training micro-batch costs beside its matmuls. Timed here, forward and backward at a GRPO
micro-batch's shapes (SmolLM2-135M: hidden 576, MLP 1536, vocabulary 49152), each variant in turn within each
repetition (the host's speed drifts), fastest repetition kept. Memory: the bytes one decoder layer keeps for its
backward (counted by autograd's saved-tensor hooks, so exact and noise-free), with and without the kernels. glibc's
heap is set to keep freed blocks (no page faults inside the timings: those belong to the allocator, not the op).

    .venv/bin/python bench/train_kernels.py --out bench/results/train_kernels.json
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python bench/train_kernels.py   # as on AVX2
    .venv/bin/python bench/train_kernels.py --quick      # small shapes, seconds
"""

from __future__ import annotations

import argparse
import ctypes
import time

import _common


def keep_heap() -> None:
    """glibc: freed blocks up to 32 MiB stay in the heap and the heap top is never trimmed (no-op elsewhere)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD


def best_of(fs: dict, reps: int) -> dict:
    """Fastest of `reps` calls per variant, the variants interleaved within each repetition (one warm-up first)."""
    best: dict = {}
    for rep in range(reps + 1):
        for name, f in fs.items():
            t = time.perf_counter()
            f()
            if rep:
                best[name] = min(best.get(name, 1e9), time.perf_counter() - t)
    return best


def fwd_bwd(fn, *shapes):
    """A closure running fn(*leaves).backward(gradient) on fresh leaf tensors of `shapes`."""
    import torch

    g = torch.Generator().manual_seed(0)
    leaves = [torch.randn(*s, generator=g).requires_grad_() for s in shapes]

    def run():
        for t in leaves:
            t.grad = None
        y = fn(*leaves)
        y.backward(torch.ones_like(y))
    return run


def layer_ops(tokens: int, hidden: int, inter: int, reps: int) -> dict:
    import torch.nn.functional as F

    from relayrl.models import fused

    def norm(x, w):  # transformers' LlamaRMSNorm in fp32
        return w * (x * (x.pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt())

    out = {}
    for name, fs in {
        "rms_norm": {"pytorch": fwd_bwd(norm, (tokens, hidden), (hidden,)),
                     "kernel": fwd_bwd(lambda x, w: fused.rms_norm(x, w, 1e-6), (tokens, hidden), (hidden,))},
        "swiglu": {"pytorch": fwd_bwd(lambda a, b: F.silu(a) * b, (tokens, inter), (tokens, inter)),
                   "kernel": fwd_bwd(fused.swiglu, (tokens, inter), (tokens, inter))},
    }.items():
        b = best_of(fs, reps)
        out[name] = {f"{k}_ms": v * 1e3 for k, v in b.items()} | {"speedup": b["pytorch"] / b["kernel"]}
    return out


def saved_bytes(tokens: int, arch: str, hidden: int, inter: int) -> dict:
    """Bytes one decoder layer keeps for backward, with PyTorch's norm/MLP and with the kernels."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from relayrl.models import fused

    cfg = AutoConfig.for_model(arch, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=1,
                               num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 192),
                               vocab_size=1024)  # SmolLM2-135M: 9 heads of 64, 3 KV heads
    out = {}
    for name in ("pytorch", "kernel"):
        model = AutoModelForCausalLM.from_config(cfg).float()
        if name == "kernel":
            fused.install(model)
        out[f"{name}_mb"] = _layer_saved_bytes(model, tokens, hidden) / 1e6
    out["saved_ratio"] = out["kernel_mb"] / out["pytorch_mb"]
    return out


def _layer_saved_bytes(model, tokens: int, hidden: int) -> int:
    """Storage bytes the model's first decoder layer saves for backward at `tokens` tokens (each storage once)."""
    import torch

    seen: set = set()
    total = 0

    def pack(t):
        nonlocal total
        key = (t.untyped_storage().data_ptr(), t.dtype)
        if key not in seen:  # a tensor saved twice (or a view of a saved one) is kept once
            seen.add(key)
            total += t.untyped_storage().nbytes()
        return t

    x = torch.randn(1, tokens, hidden, requires_grad=True)
    pos = torch.arange(tokens)[None]
    emb = model.model.rotary_emb(x, pos)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model.layers[0](x, position_embeddings=emb, attention_mask=None, position_ids=pos)
    return total


def head(rows: int, vocab: int, hidden: int, reps: int) -> dict:
    """token_logprobs forward + backward (entropy on, as the GRPO loss asks) with the blocks of the chunk budget
    (the rule before) and the cache-sized ones."""
    import torch

    from relayrl.trainer import logprobs as lp

    new = lp._block_cols
    old = lambda r, v, w: max(1, min(v, r * v // max(1, w)))  # noqa: E731 - the rule before, for comparison
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(vocab, hidden, generator=g) / hidden**0.5).requires_grad_()
    h = torch.randn(rows, hidden, generator=g).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), generator=g)

    def run(rule):
        def f():
            lp._block_cols = rule
            h.grad = weight.grad = None
            logp, ent = lp.token_logprobs(h, weight, targets, with_entropy=True)
            (logp.sum() + ent.sum()).backward()
            lp._block_cols = new
        return f

    b = best_of({"chunk_budget": run(old), "cache_sized": run(new)}, reps)
    flops = 4 * 2 * rows * vocab * hidden  # forward, recomputed logits, grad to hidden, grad to weight
    return {"rows": rows, "cols_before": old(lp.chunk_rows(vocab), vocab, rows), "cols_now": new(
        lp.chunk_rows(vocab), vocab, rows), **{f"{k}_ms": v * 1e3 for k, v in b.items()},
        **{f"{k}_gflops": flops / v / 1e9 for k, v in b.items()}, "speedup": b["chunk_budget"] / b["cache_sized"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=700, help="tokens of a micro-batch (a GRPO bench fit's ~500-1000)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None, help="result file (default: print only)")
    p.add_argument("--quick", action="store_true", help="small shapes, 2 repetitions")
    a = p.parse_args()
    keep_heap()
    import torch

    from relayrl.models import fused

    if fused.load_kernel() is None:
        raise SystemExit("the norm/SwiGLU kernel did not build here (see the warning above)")
    hidden, inter, vocab = (192, 256, 2048) if a.quick else (576, 1536, 49152)
    tokens, reps = (32, 2) if a.quick else (a.tokens, a.reps)
    res = {**_common.result_header("train_kernels"),
           "workload": {"tokens": tokens, "hidden": hidden, "intermediate": inter, "vocab": vocab, "reps": reps,
                        "threads": torch.get_num_threads()},
           "layer_ops": layer_ops(tokens, hidden, inter, reps),
           "saved_for_backward_per_layer": {arch: saved_bytes(tokens, arch, hidden, inter)
                                            for arch in ("llama", "qwen2")},
           "lm_head": [head(r, vocab, hidden, max(2, reps // 4)) for r in ((32,) if a.quick else (300, 858, 1016))]}
    print(res)
    if a.out:
        _common.write_json(a.out, res)


if __name__ == "__main__":
    main()
