#!/usr/bin/env python
"""One AdamW step over SmolLM2-135M's parameters: torch's fused fp32 AdamW, and relayrl's bf16-moment AdamW
as PyTorch slices and as the C kernel, side by side in one process, at the native ISA and as AVX2.

Why: the README job's optimizer is `Bf16StateAdamW` (12 instead of 16 bytes per parameter); its PyTorch version
took ~2 s of a ~30 s training step on 2 cores (torch profiler), a memory-bound update that should take a
fraction of that. Random weights and gradients with the model's real shapes (no weights needed); one warm-up step
creates the state, then `--steps` timed steps per side, sides interleaved; medians. Each ISA setting runs in its
own subprocess (torch reads the switches when it loads; relayrl.common.cbuild builds the kernel for that ISA).

    .venv/bin/python bench/optim_step.py      # ~1 minute; writes bench/results/optim_step.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import _common

SIDES = ("fused_fp32", "bf16_pytorch", "bf16_kernel")


def smollm2_135m_params():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)
    params = list(LlamaForCausalLM(cfg).parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    return params


def make(side: str, params):
    import torch

    from relayrl.trainer.optim import Bf16StateAdamW

    if side == "fused_fp32":
        return torch.optim.AdamW(params, lr=1e-5, fused=True)
    opt = Bf16StateAdamW(params, lr=1e-5, use_kernel=side == "bf16_kernel")
    assert (opt.kernel is not None) == (side == "bf16_kernel"), "the kernel did not build"
    return opt


def measure(steps: int) -> dict:
    """Seconds per step for each side, in this process."""
    import torch

    params = smollm2_135m_params()
    opts = {s: make(s, params) for s in SIDES}
    for opt in opts.values():
        opt.step()  # creates the state
    times: dict[str, list[float]] = {s: [] for s in SIDES}
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
    code = (f"import sys, json; sys.path.insert(0, {str(_common.REPO / 'bench')!r}); import optim_step; "
            f"print(json.dumps(optim_step.measure({steps})))")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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


if __name__ == "__main__":
    main()
