#!/usr/bin/env python
"""The training step: `bench/train.py COMMAND` (`COMMAND --help` for its options).

train_step times one GRPO optimizer step on the same batches laid out four ways; train_settings and fit_profile
(bench/_train_runs.py) time the README job's fit under different settings and profile it; random_model writes a
model folder of a real shape with random weights for the other benches. Each command's docstring says what it
measures and how.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time

import _common
from _train_runs import fit_profile, random_model, train_settings

VARIANTS = ("packed", "dense", "sorted", "padded")


# ---- train_step ------------------------------------------------------------------------------------------------
def train_step_args(argv: list[str]) -> argparse.Namespace:
    p = _common.parser("train_step", train_step.__doc__)
    p.add_argument("--model", default="smollm2", help="model folder or relayrl alias")
    p.add_argument("--prompts", type=int, default=8, help="prompts per batch")
    p.add_argument("--group", type=int, default=8, help="samples per prompt (GRPO group size)")
    p.add_argument("--resp-median", type=float, default=120.0, help="median response length (tokens)")
    p.add_argument("--resp-sigma", type=float, default=0.6, help="lognormal sigma of response lengths")
    p.add_argument("--max-new-tokens", type=int, default=256, help="response length cap")
    p.add_argument("--micro-batch-tokens", type=int, default=4096, help="packed/sorted: padded tokens per micro-batch")
    p.add_argument("--padded-rows", type=int, default=8, help="padded: sequences per micro-batch")
    p.add_argument("--steps", type=int, default=3, help="measured steps per variant (after 1 warm-up step)")
    p.add_argument("--autocast-bf16", action=argparse.BooleanOptionalAction, default=True,
                   help="bf16 autocast in forward/backward (fp32 weights), as the example configs train")
    p.add_argument("--gradient-checkpointing", action="store_true", help="as the README job trains")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS))
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    p.add_argument("--device", default="cpu", help="where the model trains: cpu, cuda, cuda:N or auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="result file (default bench/results/train_step.json; --quick: a temp file)")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny model, 4x4, short responses, 1 step")
    a = p.parse_args(argv)
    if a.quick:
        a.prompts, a.group, a.resp_median, a.max_new_tokens, a.steps = 4, 4, 24.0, 64, 1
        a.micro_batch_tokens = min(a.micro_batch_tokens, 512)
    if a.out is None:  # a smoke run must not overwrite the committed result
        a.out = os.path.join(tempfile.gettempdir(), "train_step_quick.json") if a.quick else \
            "bench/results/train_step.json"
    return a


# ---- workload --------------------------------------------------------------------------------------------
def make_batches(a, tokenizer, vocab_size: int) -> list[list]:
    """--steps + 1 batches of prompts x group samples: GSM8K prompts, lognormal response lengths."""
    from relayrl.config.schema import DatasetConfig, PromptConfig
    from relayrl.data.datasets import PromptBuilder, load_rows
    from relayrl.sample import Sample

    rng = random.Random(a.seed)
    data = DatasetConfig(source="gsm8k:train")
    rows = load_rows(data)
    build = PromptBuilder(tokenizer, PromptConfig(), data)
    batches = []
    for step in range(a.steps + 1):
        batch = []
        for p, row in enumerate(rng.sample(rows, a.prompts)):
            prompt = build(row)
            for i in range(a.group):
                n = min(a.max_new_tokens, max(1, round(rng.lognormvariate(math.log(a.resp_median), a.resp_sigma))))
                s = Sample(prompt_ids=list(prompt), group_id=f"s{step}p{p}", index=i)
                s.append_generated([rng.randrange(3, vocab_size) for _ in range(n)], [-1.0] * n, [0] * n,
                                   "length" if n == a.max_new_tokens else "stop")
                s.reward = float(rng.random() < 0.3)
                batch.append(s)
        batches.append(batch)
    return batches


def padded_batch(samples: list, rows_per_mb: int, pad_id: int):
    """The baseline layout: batch order, `rows_per_mb` sequences per micro-batch, all padded to the longest."""
    import torch.nn.functional as F

    from relayrl.trainer.packer import Packer, TrainBatch

    width = max(len(s.input_ids) for s in samples)
    mbs = []
    for start in range(0, len(samples), rows_per_mb):
        mb = Packer(1 << 40, pad_id).pack(samples[start: start + rows_per_mb]).micro_batches[0]
        extra = width - mb.input_ids.shape[1]
        mbs.append(dataclasses.replace(mb, sample_idx=[start + i for i in mb.sample_idx],
                                       input_ids=F.pad(mb.input_ids, (0, extra), value=pad_id),
                                       attention_mask=F.pad(mb.attention_mask, (0, extra), value=0)))
    return TrainBatch(samples, mbs)


def layout(a, variant: str, samples: list, pad_id: int):
    from relayrl.trainer.packer import Packer

    if variant == "padded":
        return padded_batch(samples, a.padded_rows, pad_id)
    return Packer(a.micro_batch_tokens, pad_id, share_prompt=variant in ("packed", "dense")).pack(samples)


# ---- measurement -----------------------------------------------------------------------------------------
def train_once(a, ctl, variant: str, samples: list, pad_id: int) -> dict:
    """One step as TrainController.fit runs it, with this variant's layout; timed from layout to step."""
    ctl.engine.segments = variant == "packed"  # dense: the same rows, attention through the dense mask
    t0 = time.perf_counter()
    batch = layout(a, variant, samples, pad_id)
    for stage in (ctl.compute_old_logprobs, ctl.compute_ref_logprobs, ctl.compute_values, ctl.compute_advantages):
        batch = stage(batch)
    m = ctl.train(batch)
    _common.synchronize(ctl.engine.device)  # a GPU step ends when its kernels do
    dt = time.perf_counter() - t0
    mbs = batch.micro_batches
    return {"step_s": dt, "tokens": sum(len(s.input_ids) for s in samples), "loss": m["train/loss"],
            "micro_batches": len(mbs), "forwarded_tokens": sum(mb.padded_tokens for mb in mbs),
            "real_forwarded_tokens": sum(mb.real_tokens for mb in mbs)}


def run(a, model_path: str) -> dict[str, list[dict]]:
    import torch

    from relayrl.config.schema import AlgoConfig, TrainConfig
    from relayrl.models import load_tokenizer
    from relayrl.trainer.controller import TrainController
    from relayrl.trainer.engine import TrainEngine

    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    tok = load_tokenizer(model_path)
    engine = TrainEngine.from_pretrained(model_path, dtype="float32", lr=1e-12, autocast_bf16=a.autocast_bf16,
                                         device=a.device, gradient_checkpointing=a.gradient_checkpointing)
    ctl = TrainController(engine, AlgoConfig(), TrainConfig(lr=1e-12, micro_batch_tokens=a.micro_batch_tokens),
                          pad_id=tok.pad_token_id, max_new_tokens=a.max_new_tokens)
    variants = a.variants.split(",")
    steps: dict[str, list[dict]] = {v: [] for v in variants}
    for k, samples in enumerate(make_batches(a, tok, engine.model.config.vocab_size)):
        r = k % len(variants)
        for v in variants[r:] + variants[:r]:  # rotate the order: no variant always runs first
            steps[v].append(train_once(a, ctl, v, samples, tok.pad_token_id))
            print(f"step {k} {v}: {steps[v][-1]['step_s']:.2f} s", file=sys.stderr, flush=True)
    return steps


def summarize(steps: list[dict]) -> dict:
    measured = steps[1:]  # drop the warm-up step
    med = statistics.median(s["step_s"] for s in measured)
    tokens = sum(s["tokens"] for s in measured)
    forwarded = sum(s["forwarded_tokens"] for s in measured)
    return {"tokens_per_s": tokens / sum(s["step_s"] for s in measured), "step_s_median": med,
            "step_s_all": [s["step_s"] for s in measured], "warmup_step_s": steps[0]["step_s"],
            "micro_batches": [s["micro_batches"] for s in measured],
            "forwarded_tokens_per_step": forwarded / len(measured),
            "pad_frac": 1.0 - sum(s["real_forwarded_tokens"] for s in measured) / forwarded,
            "forwarded_vs_sequence_tokens": forwarded / tokens, "loss": [s["loss"] for s in steps]}


def train_step(argv: list[str]) -> None:
    """Training throughput, packed vs padded: tokens/s of one GRPO optimizer step on the same batches.

    Variants (same samples, same TrainController path: advantages, loss, backward, clip, AdamW step):
    - packed: the Packer as relayrl trains by default (a GRPO group shares one prompt copy per row,
      rows sorted by length and cut into micro-batches of at most --micro-batch-tokens padded tokens),
      each response attending to its prompt and itself only (relayrl.models.segments);
    - dense: the same rows through SDPA with the dense [rows, L, L] mask (how packed rows attended before);
    - sorted: the Packer without prompt sharing (one sequence per row, length-sorted micro-batches);
    - padded: the usual baseline (TRL-style): one sequence per row, --padded-rows rows per micro-batch in
      batch order, every row padded to the longest sequence of the batch.
    tokens/s counts real sequence tokens (prompt + response of every sample), the same numerator for all.

    Workload: GSM8K train questions with relayrl's default prompt (chat template + boxed-answer suffix),
    response lengths drawn from a lognormal (median --resp-median, sigma --resp-sigma, capped at
    --max-new-tokens; SmolLM2 at T=1 on GSM8K) filled with random token ids. The learning rate is 1e-12 so
    every variant trains the same weights at every step (losses must agree) while doing the full work.

        .venv/bin/python bench/train.py train_step          # full run: SmolLM2-135M, 8 prompts x 8, bf16 autocast
        .venv/bin/python bench/train.py train_step --quick  # smoke run on the tiny random model (seconds)
        .venv/bin/python bench/train.py train_step --device cuda --out bench/results/gpu_train_step.json
    """
    a = train_step_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from relayrl.models import resolve_model_path, tiny_model

    model = str(tiny_model()) if a.quick else resolve_model_path(a.model)
    load = _common.load_before_run()
    steps = run(a, model)
    metrics = {v: summarize(s) for v, s in steps.items()}
    tps = {v: m["tokens_per_s"] for v, m in metrics.items()}
    losses = [m["loss"] for m in metrics.values()]
    lengths = [s["tokens"] for s in next(iter(steps.values()))]
    result = {**_common.result_header("train_step"), "metrics": metrics,
              "ratios": {f"{x}_vs_{y}_tok_s": tps[x] / tps[y] for x, y in
                         (("packed", "padded"), ("packed", "sorted"), ("sorted", "padded"), ("packed", "dense"))
                         if x in tps and y in tps},
              "workload": {"model": model, "prompts": a.prompts, "group": a.group, "dataset": "gsm8k:train",
                           "response_lengths": {"dist": "lognormal", "median": a.resp_median, "sigma": a.resp_sigma,
                                                "max": a.max_new_tokens},
                           "sequence_tokens_per_step": lengths, "micro_batch_tokens": a.micro_batch_tokens,
                           "padded_rows": a.padded_rows, "autocast_bf16": a.autocast_bf16, "train_dtype": "float32",
                           "gradient_checkpointing": a.gradient_checkpointing, "variants": list(steps),
                           "warmup_steps": 1, "measured_steps": a.steps, "threads": a.threads, "seed": a.seed,
                           "device": a.device},
              "checks": {"loadavg_1min_at_start": load,
                         # lr 1e-12: all variants train the same weights, so their losses agree up to numerics
                         "loss_max_abs_diff": max(max(col) - min(col) for col in zip(*losses))}}
    print(json.dumps(result, indent=2))
    _common.write_json(a.out, result)



COMMANDS = {"train_step": train_step, "train_settings": train_settings, "fit_profile": fit_profile,
            "random_model": random_model}

if __name__ == "__main__":
    _common.dispatch(__doc__, COMMANDS)
