"""The engine's kernels alone (`bench/kernels.py decode_attention|skinny_rows|engine_linear`): the C decode attention,
the few-row linear, and the fp32 linears' library. Each function named after its command is that command."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import _common

KERNELS = Path(__file__).with_name("kernels.py")  # the script these commands run under (and their children)
DECODE_SHAPE = {"layers": 30, "kv_heads": 3, "group": 3, "head_dim": 64}  # SmolLM2-135M's attention
SKINNY_SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]  # [out, in]
SKINNY_ROWS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
LINEAR_SHAPES = {"q_proj/o_proj": (64, 576, 576), "k_proj/v_proj": (64, 576, 192), "gate/up_proj": (64, 576, 1536),
                 "down_proj": (64, 1536, 576), "lm_head": (64, 576, 49152)}


# ---- decode_attention ------------------------------------------------------------------------------------------
def decode_measure(libs: dict, context: int, rows: int, dtype, reps: int) -> dict:
    """Min seconds of one decode step's attention (all layers) per build."""
    import torch

    from relayrl.engine import attention

    kvh, g, d = DECODE_SHAPE["kv_heads"], DECODE_SHAPE["group"], DECODE_SHAPE["head_dim"]
    caches = [(torch.randn(rows, kvh, context + 64, d).to(dtype), torch.randn(rows, kvh, context + 64, d).to(dtype))
              for _ in range(DECODE_SHAPE["layers"])]
    q, k, v = torch.randn(rows, kvh * g, 1, d), torch.randn(rows, kvh, 1, d), torch.randn(rows, kvh, 1, d)
    pos = torch.full((rows,), context, dtype=torch.int64)
    best = {name: float("inf") for name in libs}
    for rep in range(reps + 1):
        for name, lib in libs.items():
            t0 = time.perf_counter()
            for kc, vc in caches:
                attention.decode_attention(lib, q, k, v, kc, vc, pos, d ** -0.5)
            if rep:  # the first pass warms up
                best[name] = min(best[name], time.perf_counter() - t0)
    kv_gb = sum(2 * kc[:, :, : context + 1].numel() * kc.element_size() for kc, _ in caches) / 1e9
    return {"context": context, "rows": rows, "kv_dtype": str(dtype).removeprefix("torch."), "kv_read_gb": kv_gb,
            **{f"{name}_ms": 1e3 * s for name, s in best.items()},
            **{f"{name}_gb_per_s": kv_gb / s for name, s in best.items()}}


def decode_attention(argv: list[str]) -> None:
    """The C decode-attention kernel alone, per decode step: fp32 and bf16 KV caches, optionally against another
    build of the kernel (e.g. the previous commit's source) in the same process, alternating.

    Why: a decode step's attention reads every running sequence's keys and values once per layer, so at long contexts
    it is a large part of the step, and the engine's step times on a shared 2-core host move by +-15% from run to run;
    timing the kernel alone over 30 layers' distinct caches (more than any cache level), min of --reps passes, side by
    side, says what a kernel change or the cache's dtype does.

        .venv/bin/python bench/kernels.py decode_attention                     # this checkout's kernel
        git show HEAD~1:relayrl/engine/kernels/decode_attention.c > /tmp/old.c
        .venv/bin/python bench/kernels.py decode_attention --baseline-source /tmp/old.c \\
            --out bench/results/decode_attention.json
    """
    p = _common.parser("decode_attention", decode_attention.__doc__)
    p.add_argument("--contexts", default="100,1000", help="positions attended per sequence")
    p.add_argument("--rows", default="32,64", help="sequences decoded together")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--baseline-source", help="another decode_attention.c to build and time beside this one")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    import torch

    from relayrl.engine import attention

    # built as the engine builds it (relayrl.common.cbuild: its flags, its ISA, its cache); a baseline source must
    # define every variant this one does (relayrl_decode_attention_f32_bf16kv: since 8e1d458)
    libs = _common.kernel_builds(attention.load_kernel(), attention.build, a.baseline_source)
    cases = []
    for context in map(int, a.contexts.split(",")):
        for rows in map(int, a.rows.split(",")):
            for dtype in (torch.float32, torch.bfloat16):
                c = decode_measure(libs, context, rows, dtype, a.reps)
                if "baseline_ms" in c:
                    c["kernel_vs_baseline_time"] = c["kernel_ms"] / c["baseline_ms"]
                print({k: round(v, 3) if isinstance(v, float) else v for k, v in c.items()}, file=sys.stderr)
                cases.append(c)
    res = {**_common.result_header("decode_attention"), "shape": DECODE_SHAPE, "reps": a.reps,
           "baseline_source": a.baseline_source, "cases": cases}
    print(json.dumps(res, indent=2))
    if a.out:
        _common.write_json(a.out, res)


# ---- skinny_rows -----------------------------------------------------------------------------------------------
def skinny_variants(also: str | None) -> dict:
    """name -> f(x, w) for PyTorch's linear, this kernel and (`also`) another source of it (its row limit:
    whatever that source accepts; a refusal skips the row count)."""
    import torch.nn.functional as F

    from relayrl.common import cbuild
    from relayrl.engine import skinny

    out = {"pytorch": F.linear}
    kernels = {"kernel": skinny.load_kernel()}
    if also:
        # only the entry this bench calls: sources before the multi call (0a9ae4f) define no relayrl_skinny_multi_f32
        single = {k: v for k, v in skinny.SIGNATURES.items() if k == "relayrl_skinny_linear_f32"}
        kernels["kernel_also"] = cbuild.load(Path(also), signatures=single, fallback="not compared")
    for name, lib in kernels.items():
        if lib is None:
            raise SystemExit(f"{name}: the kernel did not build (see the warning above)")
        out[name] = lambda x, w, lib=lib: skinny.skinny_linear(lib, x, w, None)
    return out


def time_rows(fs: dict, layers: list, m: int, reps: int) -> dict:
    """Fastest of `reps` passes over every layer's weights at m rows, per variant (variants interleaved)."""
    import torch

    xs = {k: torch.randn(m, k) for k in {w.shape[1] for w in layers[0]}}
    best: dict = {}
    for rep in range(reps + 1):  # the first pass warms up
        for name, f in fs.items():
            try:
                t = time.perf_counter()
                for layer in layers:
                    for w in layer:
                        f(xs[w.shape[1]], w)
                dt = time.perf_counter() - t
            except RuntimeError:  # a row count that version refuses
                continue
            if rep:
                best[name] = min(best.get(name, dt), dt)
    return best


def skinny_row(best: dict, m: int, flops_per_row: int) -> dict:
    row = {"rows": m, **{f"{k}_ms": v * 1e3 for k, v in best.items()},
           **{f"{k}_gflops": flops_per_row * m / v / 1e9 for k, v in best.items()}}
    for k in best:
        if k != "pytorch" and "pytorch" in best:
            row[f"{k}_vs_pytorch"] = best["pytorch"] / best[k]
    if "kernel_also" in best:
        row["kernel_vs_also"] = best["kernel_also"] / best["kernel"]
    return row


def skinny_rows(argv: list[str]) -> None:
    """A CPU engine's fp32 linears at 1-64 rows: PyTorch's F.linear against relayrl's few-row kernel
    (relayrl/engine/kernels/skinny_linear.c), and optionally against another version of that kernel's source.

    Why: a decode step multiplies as many rows as sequences are running by weights that do not fit in cache; this times
    one pass over 30 layers' distinct weights of SmolLM2-135M's shapes (q, k, v, o, gate, up, down: 430 MB of fp32) at
    each row count, every variant in turn within each repetition (the host's speed drifts), and keeps each variant's
    fastest repetition. The engine's own row limit is what relayrl.engine.skinny measures once per machine; this shows
    the whole curve.

        .venv/bin/python bench/kernels.py skinny_rows --out bench/results/skinny_rows.json
        git show REV:relayrl/engine/kernels/skinny_linear.c > /tmp/skinny_linear_before.c
        .venv/bin/python bench/kernels.py skinny_rows --also /tmp/skinny_linear_before.c   # a version beside this one
        .venv/bin/python bench/kernels.py skinny_rows --quick      # 2 layers, 3 row counts, seconds
    """
    p = _common.parser("skinny_rows", skinny_rows.__doc__)
    p.add_argument("--also", help="another skinny_linear.c to time beside this one (e.g. an earlier revision)")
    p.add_argument("--reps", type=int, default=11)
    p.add_argument("--out", default=None, help="result file (default: print only)")
    p.add_argument("--quick", action="store_true", help="2 layers, 3 row counts, 2 repetitions")
    a = p.parse_args(argv)
    import torch

    n_layers, rows, reps = (2, (1, 8, 64), 2) if a.quick else (30, SKINNY_ROWS, a.reps)
    torch.manual_seed(0)
    layers = [[torch.randn(n, k) / k**0.5 for n, k in SKINNY_SHAPES] for _ in range(n_layers)]
    flops_per_row = 2 * n_layers * sum(n * k for n, k in SKINNY_SHAPES)
    fs = skinny_variants(a.also)
    x = torch.randn(5, 576)
    for name, f in fs.items():  # every variant computes the same product before it is timed
        if not torch.allclose(f(x, layers[0][0]), x @ layers[0][0].T, rtol=1e-4, atol=1e-4):
            raise SystemExit(f"{name} disagrees with x @ w.T")
    table = []
    with torch.inference_mode():
        for m in rows:
            table.append(skinny_row(time_rows(fs, layers, m, reps), m, flops_per_row))
            print({k: round(v, 2) if isinstance(v, float) else v for k, v in table[-1].items()}, flush=True)
    res = {**_common.result_header("skinny_rows"), "workload": {
        "layers": n_layers, "shapes_out_in": SKINNY_SHAPES, "weights_mb": flops_per_row / 2 * 4 / 1e6, "reps": reps,
        "threads": torch.get_num_threads(), "also": a.also}, "rows": table}
    if a.out:
        _common.write_json(a.out, res)


# ---- engine_linear ---------------------------------------------------------------------------------------------
def engine_linear_args(argv: list[str]) -> argparse.Namespace:
    p = _common.parser("engine_linear", engine_linear.__doc__)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=70)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None, help="result file (default: print only)")
    p.add_argument("--quick", action="store_true", help="tiny model, 2 prompts x 2, 8 tokens, 1 round")
    p.add_argument("--side", choices=("default", "onednn"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.quick:
        from relayrl.models import tiny_model

        a.model, a.prompts, a.group, a.prompt_len, a.max_new_tokens, a.rounds = str(tiny_model("qwen2")), 2, 2, 10, 8, 1
    return a


def shape_rates(seconds: float = 0.2) -> dict:
    import torch
    import torch.nn.functional as F

    from relayrl.engine.linear import _onednn, _seconds

    out = {}
    with torch.inference_mode():
        for name, (m, k, n) in LINEAR_SHAPES.items():
            x, w = torch.randn(m, k), torch.randn(n, k) / k**0.5
            flop = 2 * m * k * n
            out[name] = {"default_gflops": flop / _seconds(lambda: F.linear(x, w), seconds) / 1e9,  # noqa: B023
                         "onednn_gflops": flop / _seconds(lambda: _onednn(x, w, None), seconds) / 1e9}  # noqa: B023
    return out


def linear_side(a) -> dict:
    from relayrl.engine.base import SamplingParams
    from relayrl.engine.local import LocalEngine
    from relayrl.models import resolve_model_path

    engine = LocalEngine.from_pretrained(resolve_model_path(a.model), dtype="float32",
                                         max_batch_size=a.prompts * a.group, linear=a.side)
    prompts = [[1 + i] * a.prompt_len for i in range(a.prompts)]
    engine.generate(prompts[:1], SamplingParams(max_new_tokens=4, temperature=1.0, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    outs = engine.generate([p for p in prompts for _ in range(a.group)],
                           SamplingParams(max_new_tokens=a.max_new_tokens, temperature=1.0, ignore_eos=True))
    seconds = time.perf_counter() - t0
    engine.close()
    return {"linear": engine.linear, "seconds": seconds, "tokens": sum(len(o.output_ids) for o in outs)}


def engine_linear(argv: list[str]) -> None:
    """A CPU engine's fp32 linears: PyTorch's default (MKL sgemm) vs oneDNN (relayrl.engine.linear), side by side.

    Two measurements in one run: each library's GFLOP/s at SmolLM2-135M's decode shapes (64 rows x the layer
    projections, the LM head), and LocalEngine generating --prompts x --group samples of --max-new-tokens tokens from
    --prompt-len-token prompts with `linear="default"` and `linear="onednn"`, each in its own subprocess, alternating
    for --rounds rounds (model loading excluded). The engine's own choice (`linear="auto"`) is what the machine's
    cached measurement says; this bench shows what it buys.

        .venv/bin/python bench/kernels.py engine_linear --out bench/results/engine_linear.json
        .venv/bin/python bench/kernels.py engine_linear --quick     # tiny model, seconds
    """
    a = engine_linear_args(argv)
    if a.side:
        print(json.dumps(linear_side(a)))
        return
    runs: dict[str, list[dict]] = {"default": [], "onednn": []}
    for _ in range(a.rounds):
        for side in runs:
            proc = subprocess.run([sys.executable, str(KERNELS), "engine_linear", *argv, "--side", side],
                                  capture_output=True, text=True, check=True)
            runs[side].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(side, runs[side][-1], flush=True)
    medians = {s: statistics.median(r["seconds"] for r in rs) for s, rs in runs.items()}
    res = {**_common.result_header("engine_linear"),
           "workload": {"model": a.model, "prompts": a.prompts, "group": a.group, "prompt_len": a.prompt_len,
                        "max_new_tokens": a.max_new_tokens, "dtype": "float32"},
           "shapes_gflops": shape_rates(0.02 if a.quick else 0.2), "runs": runs, "seconds_median": medians,
           "onednn_vs_default_speedup": medians["default"] / medians["onednn"]}
    print(json.dumps(res, indent=2))
    if a.out and not a.quick:
        _common.write_json(a.out, res)
