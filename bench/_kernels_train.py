"""The trainer's kernels alone (`bench/kernels.py segment_attention|train_kernels|optim_step`): the shared-prompt
attention, the one-pass RMSNorm/SwiGLU and the LM head's blocks, the bf16-moment AdamW. Each function named after
its command is that command."""

from __future__ import annotations

import ctypes
import json
import os
import random
import statistics
import subprocess
import sys
import time

import _common

SEGMENT_SHAPE = {"layers": 30, "heads": 9, "kv_heads": 3, "head_dim": 64}  # SmolLM2-135M's attention
LENGTHS = (20, 30, 40, 50, 60, 128)  # response lengths drawn per row: the GRPO bench's spread up to its 128 cap
OPTIM_SIDES = ("fused_fp32", "bf16_pytorch", "bf16_kernel")


# ---- segment_attention -----------------------------------------------------------------------------------------
def micro_batch(rows: int, group: int, seed: int):
    """A seeded layout of `rows` rows [prompt, group responses], and its visible (query head, key) pairs."""
    from relayrl.models.segments import segment_layout

    rng = random.Random(seed)
    prompt_lens, spans, width, pairs = [], [], 0, 0
    for _ in range(rows):
        p = rng.randint(25, 35)
        start, row = p, []
        pairs += p * (p + 1) // 2
        for _ in range(group):
            n = rng.choice(LENGTHS)
            row.append((start, n))
            pairs += n * p + n * (n + 1) // 2
            start += n
        prompt_lens.append(p)
        spans.append(row)
        width = max(width, start)
    return segment_layout(prompt_lens, spans, width), width, pairs * SEGMENT_SHAPE["heads"]


def segment_times(libs: dict, layout, tensors: list, rows: int, width: int, reps: int) -> dict:
    """Per build: the forward and backward seconds of each pass over every layer's tensors (after a warm-up)."""
    import torch

    h, kvh, d = SEGMENT_SHAPE["heads"], SEGMENT_SHAPE["kv_heads"], SEGMENT_SHAPE["head_dim"]
    prompt_lens, spans = layout.prompt_lens.contiguous(), layout.spans.contiguous()
    threads = torch.get_num_threads()
    times = {name: ([], []) for name in libs}
    for rep in range(reps + 1):
        for name, lib in libs.items():
            fwd = bwd = 0.0
            for q, k, v, out, lse, dout, dq, dk, dv in tensors:
                head = (rows, width, kvh, h // kvh, d, q.data_ptr(), k.data_ptr(), v.data_ptr(), prompt_lens.data_ptr(),
                        spans.shape[0], spans.data_ptr(), d ** -0.5)
                t0 = time.perf_counter()
                lib.relayrl_segment_attention_fwd(*head, out.data_ptr(), lse.data_ptr(), threads)
                t1 = time.perf_counter()
                for g in (dq, dk, dv):  # the trainer hands the kernel zeroed gradients
                    g.zero_()
                t2 = time.perf_counter()
                lib.relayrl_segment_attention_bwd(*head, out.data_ptr(), lse.data_ptr(), dout.data_ptr(), dq.data_ptr(),
                                                  dk.data_ptr(), dv.data_ptr(), threads)
                fwd, bwd = fwd + t1 - t0, bwd + time.perf_counter() - t2
            if rep:  # the first pass warms up
                times[name][0].append(fwd)
                times[name][1].append(bwd)
    return times


def segment_measure(libs: dict, rows: int, group: int, layers: int, reps: int) -> dict:
    """Median seconds of `layers` forward and backward calls per build, each layer on its own tensors."""
    import torch

    layout, width, pairs = micro_batch(rows, group, seed=rows)
    h, kvh, d = SEGMENT_SHAPE["heads"], SEGMENT_SHAPE["kv_heads"], SEGMENT_SHAPE["head_dim"]
    tensors = []
    for _ in range(layers):
        q, k, v = torch.randn(rows, h, width, d), torch.randn(rows, kvh, width, d), torch.randn(rows, kvh, width, d)
        out, lse, dout = torch.zeros(rows, width, h, d), torch.zeros(rows, h, width), torch.randn(rows, width, h, d)
        tensors.append((q, k, v, out, lse, dout, torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)))
    times = segment_times(libs, layout, tensors, rows, width, reps)
    case = {"rows": rows, "width": width, "visible_pairs_per_layer": pairs, "layers": layers}
    for name, (f, b) in times.items():
        fm, bm = statistics.median(f), statistics.median(b)
        case |= {f"{name}_fwd_ms": 1e3 * fm, f"{name}_bwd_ms": 1e3 * bm,
                 f"{name}_fwd_gflops": layers * pairs * 4 * d / fm / 1e9,
                 f"{name}_bwd_gflops": layers * pairs * 10 * d / bm / 1e9}
    if "baseline" in libs:
        case |= {"fwd_speedup": case["baseline_fwd_ms"] / case["kernel_fwd_ms"],
                 "bwd_speedup": case["baseline_bwd_ms"] / case["kernel_bwd_ms"]}
    return case


def segment_attention(argv: list[str]) -> None:
    """The trainer's shared-prompt attention kernel alone (relayrl/models/kernels/segment_attention.c), forward and
    backward, at the GRPO bench's shapes, optionally against another build of it (e.g. the previous commit's source)
    in the same process, alternating.

    Why: in the GRPO bench's fit (bench/train.py fit_profile) this attention was the largest cost after the matmuls,
    and a fit's time moves by +-10% from run to run on a shared host, so a kernel change is judged here, on the C calls
    alone: SmolLM2-135M's heads (9 query heads over 3 KV heads of 64), one micro-batch of one or two rows [prompt, 8
    responses] as the packer lays out a GRPO group (relayrl.trainer.packer), the 30 layers' calls of a fit's
    micro-batch in one pass; the median of --reps passes per build and FLOP rates (forward 4 D and backward 10 D per
    visible (query head, key) pair: scores, probabilities times values; and again scores, dout . v, dq, dk, dv).

        .venv/bin/python bench/kernels.py segment_attention                   # this checkout's kernel
        git show HEAD~1:relayrl/models/kernels/segment_attention.c > /tmp/old.c
        .venv/bin/python bench/kernels.py segment_attention --baseline-source /tmp/old.c \\
            --out bench/results/segment_attention.json
    """
    p = _common.parser("segment_attention", segment_attention.__doc__)
    p.add_argument("--rows", default="1,2", help="rows per micro-batch (a 1024-token budget holds one or two)")
    p.add_argument("--group", type=int, default=8, help="responses per row")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--baseline-source", help="another segment_attention.c to build and time beside this one")
    p.add_argument("--quick", action="store_true", help="3 layers, 2 passes: a smoke run")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    from relayrl.models import segments

    libs = _common.kernel_builds(segments.load_kernel(), segments.build, a.baseline_source)
    layers, reps = (3, 2) if a.quick else (SEGMENT_SHAPE["layers"], a.reps)
    cases = []
    for rows in map(int, a.rows.split(",")):
        c = segment_measure(libs, rows, a.group, layers, reps)
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in c.items()}, file=sys.stderr)
        cases.append(c)
    res = {**_common.result_header("segment_attention"), "shape": SEGMENT_SHAPE, "group": a.group, "reps": reps,
           "baseline_source": a.baseline_source, "cases": cases}
    print(json.dumps(res, indent=2))
    if a.out:
        _common.write_json(a.out, res)


# ---- train_kernels ---------------------------------------------------------------------------------------------
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


def train_kernels(argv: list[str]) -> None:
    """The trainer's one-pass RMSNorm and SwiGLU (relayrl/models/kernels/norm_swiglu.c) against PyTorch's ops, and the
    LM head's vocabulary blocks (relayrl.trainer.logprobs) cache-sized against the chunk budget's: time and memory.

    Why: both change what a training micro-batch costs beside its matmuls. Timed here, forward and backward at a GRPO
    micro-batch's shapes (SmolLM2-135M: hidden 576, MLP 1536, vocabulary 49152), each variant in turn within each
    repetition (the host's speed drifts), fastest repetition kept. Memory: the bytes one decoder layer keeps for its
    backward (counted by autograd's saved-tensor hooks, so exact and noise-free), with and without the kernels.
    glibc's heap is set to keep freed blocks (no page faults inside the timings: those belong to the allocator, not
    the op).

        .venv/bin/python bench/kernels.py train_kernels --out bench/results/train_kernels.json
        ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python bench/kernels.py train_kernels  # as AVX2
        .venv/bin/python bench/kernels.py train_kernels --quick      # small shapes, seconds
    """
    p = _common.parser("train_kernels", train_kernels.__doc__)
    p.add_argument("--tokens", type=int, default=700, help="tokens of a micro-batch (a GRPO bench fit's ~500-1000)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None, help="result file (default: print only)")
    p.add_argument("--quick", action="store_true", help="small shapes, 2 repetitions")
    a = p.parse_args(argv)
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


# ---- optim_step ------------------------------------------------------------------------------------------------
def smollm2_135m_params():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)
    params = list(LlamaForCausalLM(cfg).parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    return params


def make_optimizer(side: str, params):
    import torch

    from relayrl.trainer.optim import Bf16StateAdamW

    if side == "fused_fp32":
        return torch.optim.AdamW(params, lr=1e-5, fused=True)
    opt = Bf16StateAdamW(params, lr=1e-5, use_kernel=side == "bf16_kernel")
    assert (opt.kernel is not None) == (side == "bf16_kernel"), "the kernel did not build"
    return opt


def optim_measure(steps: int) -> dict:
    """Seconds per step for each side, in this process."""
    import torch

    params = smollm2_135m_params()
    opts = {s: make_optimizer(s, params) for s in OPTIM_SIDES}
    for opt in opts.values():
        opt.step()  # creates the state
    times: dict[str, list[float]] = {s: [] for s in OPTIM_SIDES}
    for _ in range(steps):
        for side, opt in opts.items():
            t = time.perf_counter()
            opt.step()
            times[side].append(time.perf_counter() - t)
    return {"capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
            "params": sum(p.numel() for p in params),
            "sides": {s: {"median_s": statistics.median(t), "min_s": min(t), "max_s": max(t), "times_s": t}
                      for s, t in times.items()}}


def run_isa(isa: str, steps: int) -> dict:
    env = {**os.environ, **(_common.AVX2_ENV if isa == "avx2" else {})}
    code = (f"import sys, json; sys.path.insert(0, {str(_common.REPO / 'bench')!r}); import _kernels_train; "
            f"print(json.dumps(_kernels_train.optim_measure({steps})))")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def optim_step(argv: list[str]) -> None:
    """One AdamW step over SmolLM2-135M's parameters: torch's fused fp32 AdamW, and relayrl's bf16-moment AdamW
    as PyTorch slices and as the C kernel, side by side in one process, at the native ISA and as AVX2.

    Why: the README job's optimizer is `Bf16StateAdamW` (12 instead of 16 bytes per parameter); its PyTorch version
    took ~2 s of a ~30 s training step on 2 cores (torch profiler), a memory-bound update that should take a
    fraction of that. Random weights and gradients with the model's real shapes (no weights needed); one warm-up step
    creates the state, then `--steps` timed steps per side, sides interleaved; medians. Each ISA setting runs in its
    own subprocess (torch reads the switches when it loads; relayrl.common.cbuild builds the kernel for that ISA).

        .venv/bin/python bench/kernels.py optim_step   # ~1 minute; writes bench/results/optim_step.json
    """
    p = _common.parser("optim_step", optim_step.__doc__)
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--out", default=str(_common.REPO / "bench/results/optim_step.json"))
    a = p.parse_args(argv)
    res = _common.result_header("optim_step") | {"load_before": _common.load_before_run()}
    res["isa"] = {isa: run_isa(isa, a.steps) for isa in ("native", "avx2")}
    res["ratios"] = {}
    for isa, r in res["isa"].items():
        med = {s: v["median_s"] for s, v in r["sides"].items()}
        res["ratios"][f"{isa}_pytorch_vs_kernel"] = med["bf16_pytorch"] / med["bf16_kernel"]
        res["ratios"][f"{isa}_fused_fp32_vs_kernel"] = med["fused_fp32"] / med["bf16_kernel"]
        print(f"{isa:6s} ({r['capability']}, {r['threads']} threads, {r['params'] / 1e6:.1f}M params): "
              + ", ".join(f"{s} {v:.3f} s" for s, v in med.items()))
    _common.write_json(a.out, res)
    print(json.dumps(res["ratios"], indent=1))
    print(f"wrote {a.out}")
