#!/usr/bin/env python
"""A CPU engine's fp32 linears: PyTorch's default (MKL sgemm) vs oneDNN (relayrl.engine.linear), side by side.

Two measurements in one run: each library's GFLOP/s at SmolLM2-135M's decode shapes (64 rows x the layer
projections, the LM head), and LocalEngine generating --prompts x --group samples of --max-new-tokens tokens from
--prompt-len-token prompts with `linear="default"` and `linear="onednn"`, each in its own subprocess, alternating
for --rounds rounds (model loading excluded). The engine's own choice (`linear="auto"`) is what the machine's
cached measurement says; this bench shows what it buys.

    .venv/bin/python bench/engine_linear.py --out bench/results/engine_linear.json
    .venv/bin/python bench/engine_linear.py --quick     # tiny model, seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import _common

SHAPES = {"q_proj/o_proj": (64, 576, 576), "k_proj/v_proj": (64, 576, 192), "gate/up_proj": (64, 576, 1536),
          "down_proj": (64, 1536, 576), "lm_head": (64, 576, 49152)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
        for name, (m, k, n) in SHAPES.items():
            x, w = torch.randn(m, k), torch.randn(n, k) / k**0.5
            flop = 2 * m * k * n
            out[name] = {"default_gflops": flop / _seconds(lambda: F.linear(x, w), seconds) / 1e9,  # noqa: B023
                         "onednn_gflops": flop / _seconds(lambda: _onednn(x, w, None), seconds) / 1e9}  # noqa: B023
    return out


def one_side(a) -> dict:
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


def main() -> None:
    a = parse_args()
    if a.side:
        print(json.dumps(one_side(a)))
        return
    runs: dict[str, list[dict]] = {"default": [], "onednn": []}
    for _ in range(a.rounds):
        for side in runs:
            proc = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--side", side], capture_output=True,
                                  text=True, check=True)
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


if __name__ == "__main__":
    main()
