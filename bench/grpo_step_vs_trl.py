#!/usr/bin/env python
"""One GRPO training step, relayrl vs TRL's GRPOTrainer: same model, prompts, group size, generation length,
temperature, learning rate and one optimizer step per batch of prompts x group completions.

A step is everything between two optimizer updates: generation, reward, logprobs, loss/backward, optimizer step
and (relayrl only) the weight sync to its inference engine. Each side runs in its own subprocess (this script with
--side), alternating sides for --rounds rounds; each subprocess does 1 warm-up step + --steps measured steps.

    .venv/bin/python bench/grpo_step_vs_trl.py            # full run (SmolLM2-135M-Instruct, 8x8, 128 tokens)
    .venv/bin/python bench/grpo_step_vs_trl.py --quick    # smoke run on the tiny random model (< 60 s)
    python bench/grpo_step_vs_trl.py --device cuda        # on a GPU: relayrl's engine (CUDA graphs) and trainer vs
                                                          # TRL's HF generate + Trainer, both on the GPU
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import resource
import statistics
import sys
import tempfile
import time

import _common

SIDES = ("relayrl", "trl", "trl_bf16")
SUFFIX = "\nPut your final answer within \\boxed{}."  # data.prompt.suffix of reasoning_gym: sources
DATA_KW = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+", "-", "*"],
           "allow_parentheses": False, "allow_negation": False}
LR = 5e-6  # examples/arithmetic_grpo.yaml


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="model folder or relayrl alias")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="samples per prompt (GRPO group size)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=3, help="measured steps per subprocess (after 1 warm-up step)")
    p.add_argument("--rounds", type=int, default=1, help="rounds of one subprocess per side, sides alternating")
    p.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated subset of {','.join(SIDES)}")
    p.add_argument("--seed", type=int, default=0, help="run seed and reasoning-gym dataset seed")
    p.add_argument("--seeds", help="comma-separated seeds, each a full comparison on its own prompts and samples "
                                   "(answer lengths are sampled and move one seed's ratio: report the median)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads on both sides")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where both sides generate and train")
    p.add_argument("--fixed-length", action="store_true",
                   help="every answer exactly --max-new-tokens long on both sides (relayrl sampling.ignore_eos, TRL "
                        "min_new_tokens): steps compared at equal lengths, whatever each side happens to sample")
    p.add_argument("--trl-micro-batch", type=int, default=8,
                   help="TRL per_device_train_batch_size; gradient_accumulation = prompts*group / this")
    p.add_argument("--relayrl-checkpointing", choices=["false", "true"], default="false",
                   help="relayrl's model.gradient_checkpointing (TRL's side runs without; the README job with)")
    p.add_argument("--out", default="bench/results/grpo_step_vs_trl.json")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny model, 2x2, 16 tokens, 1 step")
    p.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # internal: run one side, write --result-file
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.quick:
        a.prompts, a.group, a.max_new_tokens, a.steps = 2, 2, 16, 1
    a.sides = [s.strip() for s in a.sides.split(",") if s.strip()]
    try:
        a.seeds = [int(x) for x in a.seeds.split(",") if x.strip()] if a.seeds else [a.seed]
    except ValueError:
        p.error(f"--seeds must be comma-separated integers, got {a.seeds!r}")
    if bad := [s for s in a.sides if s not in SIDES]:
        p.error(f"unknown sides {bad}; choose from {SIDES}")
    total = a.prompts * a.group
    a.trl_micro_batch = min(a.trl_micro_batch, total)
    if total % a.trl_micro_batch:
        p.error(f"--trl-micro-batch {a.trl_micro_batch} must divide prompts*group = {total}")
    return a


def dataset_cfg(a):
    from relayrl.config.schema import DatasetConfig

    return DatasetConfig(source="reasoning_gym:basic_arithmetic", size=a.prompts * (a.steps + 1), seed=a.seed,
                         kwargs=DATA_KW)


def prompts_sha(questions) -> str:
    return hashlib.sha256(json.dumps(sorted(set(questions))).encode()).hexdigest()[:12]


# ---- relayrl side ------------------------------------------------------------------------------------------
def run_relayrl(a, tmp: str) -> dict:
    from relayrl.config.schema import load_run_config
    from relayrl.run.build import build
    from relayrl.run.evaluator import rollout_metrics

    d = dataset_cfg(a)
    # precision as the README job (examples/arithmetic_grpo.yaml) ships it (engine.dtype auto), its 1024-token
    # micro-batches and bf16 AdamW moments; gradient checkpointing as a.relayrl_checkpointing says: off by default,
    # as on the TRL side. The README job turns it on to stay under 3 GB; it costs the fit 17-40% on a 2-core Zen 3
    # (bench/results/train_settings_ckpt_128_zen3.json, fit_profile) and TRL's side does not pay it either.
    overrides = [f"model.path={a.model}", "engine.dtype=auto", "model.autocast_bf16=auto",
                 f"model.gradient_checkpointing={a.relayrl_checkpointing}", "train.micro_batch_tokens=1024",
                 "train.optimizer_state_dtype=bfloat16",
                 f"sampling.max_new_tokens={a.max_new_tokens}", f"sampling.temperature={a.temperature}",
                 f"data.train.source={d.source}", f"data.train.size={d.size}", f"data.train.seed={d.seed}",
                 f"data.train.kwargs={json.dumps(d.kwargs)}", f"data.batch_size={a.prompts}",
                 f"data.group_size={a.group}", "data.shuffle=false", f"train.lr={LR}",
                 "eval.at_start=false", "eval.at_end=false", "run.tensorboard=false", f"run.output_dir={tmp}",
                 "run.name=bench", f"run.seed={a.seed}", f"run.threads={a.threads}", f"run.steps={a.steps + 1}",
                 "run.print_samples=0", f"run.device={a.device}", f"sampling.ignore_eos={a.fixed_length}"]
    c = build(load_run_config(None, overrides))
    steps = []
    try:
        for _ in range(a.steps + 1):  # timed exactly as relayrl.run.loop.train_steps times a step
            sync0, version0 = c.rollout_ctl.stats["weight_update_s"], c.train_ctl.version
            t0 = time.perf_counter()
            m = c.env.produce_batch(c.data, a.prompts)
            batch = c.data.get_batch()
            m |= rollout_metrics(batch)
            m |= c.train_ctl.fit(batch)
            c.rollout_ctl.load_weights(c.train_ctl.weights())
            dt = time.perf_counter() - t0
            lengths = [len(s.response_ids) for s in batch]
            steps.append({"step_s": dt, "samples": len(batch), "gen_tokens": sum(lengths),
                          "max_len": max(lengths), "rollout_s": m["time/rollout_s"], "train_s": m["time/train_s"],
                          "weight_sync_s": c.rollout_ctl.stats["weight_update_s"] - sync0,
                          "reward_mean": m["rollout/reward_mean"],
                          "optimizer_steps": c.train_ctl.version - version0,  # 1 update per fit (epochs=minibatches=1)
                          "prompts_sha": prompts_sha(s.data["question"] for s in batch)})
    finally:
        c.close()
    cfg = c.cfg
    return {"steps": steps, "settings": {"train_dtype": cfg.model.train_dtype, "bf16_autocast": cfg.model.autocast_bf16,
                                         "engine_dtype": cfg.engine.dtype, "loss_agg": cfg.algo.loss_agg,
                                         "micro_batch_tokens": cfg.train.micro_batch_tokens,
                                         "gradient_checkpointing": cfg.model.gradient_checkpointing,
                                         "optimizer_state_dtype": cfg.train.optimizer_state_dtype}}


# ---- TRL side ----------------------------------------------------------------------------------------------
def run_trl(a, tmp: str, bf16: bool) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from relayrl.data import load_rows
    from relayrl.judge.math import math_reward

    rows = load_rows(dataset_cfg(a))
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": r["question"] + SUFFIX}], "answer": r["answer"]}
                            for r in rows])
    gens = []  # one entry per generation (= per optimizer step when steps line up)

    def math_reward_fn(prompts, completions, completion_ids, answer, **_):
        gens.append({"samples": len(completions), "gen_tokens": sum(map(len, completion_ids)),
                     "max_len": max(map(len, completion_ids)),
                     "prompts_sha": prompts_sha(p[-1]["content"][: -len(SUFFIX)] for p in prompts)})
        rewards = [math_reward(c[-1]["content"], {"answer": ans})["reward"] for c, ans in zip(completions, answer)]
        gens[-1]["reward_mean"] = statistics.fmean(rewards)
        return rewards

    class StepTimer(TrainerCallback):  # on_step_begin..on_step_end spans generation + all micro-steps + opt step
        def __init__(self):
            self.t0, self.micro, self.times, self.micros, self.spans = 0.0, 0, [], [], []

        def on_step_begin(self, args, state, control, **kw):
            self.t0, self.micro = time.perf_counter(), 0

        def on_substep_end(self, args, state, control, **kw):
            self.micro += 1

        def on_step_end(self, args, state, control, **kw):
            self.spans.append((self.t0, time.perf_counter()))
            self.times.append(self.spans[-1][1] - self.t0)
            self.micros.append(self.micro + 1)

    total = a.prompts * a.group
    args = GRPOConfig(
        output_dir=tmp, use_cpu=a.device == "cpu", bf16=bf16, fp16=False, seed=a.seed, data_seed=a.seed,
        use_vllm=False, gradient_checkpointing=False,  # TRL defaults to True; relayrl's default is off
        num_generations=a.group, per_device_train_batch_size=a.trl_micro_batch,
        gradient_accumulation_steps=total // a.trl_micro_batch,  # generation_batch_size = micro * accum = total
        num_iterations=1, max_completion_length=a.max_new_tokens, temperature=a.temperature, top_p=1.0, top_k=0,
        beta=0.0, learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
        max_steps=a.steps + 1, shuffle_dataset=False, report_to="none", save_strategy="no", eval_strategy="no",
        logging_strategy="no", disable_tqdm=True, log_completions=False, dataloader_num_workers=0,
        generation_kwargs={"min_new_tokens": a.max_new_tokens} if a.fixed_length else None)
    assert args.generation_batch_size == total and args.steps_per_generation == args.gradient_accumulation_steps
    timer = StepTimer()
    trainer = GRPOTrainer(model=a.model, reward_funcs=math_reward_fn, args=args, train_dataset=ds,
                          callbacks=[timer])
    gen_times, gen_spans = [], []
    inner = trainer._generate_and_score_completions

    def timed_generate(batch):  # generation + reward + advantages (TRL's "rollout")
        t = time.perf_counter()
        out = inner(batch)
        gen_spans.append((t, time.perf_counter()))
        gen_times.append(gen_spans[-1][1] - t)
        return out

    trainer._generate_and_score_completions = timed_generate
    trainer.train()
    if not (len(timer.times) == len(gens) == len(gen_times) == trainer.state.global_step == a.steps + 1):
        raise RuntimeError(f"expected {a.steps + 1} steps with one generation each, got {len(timer.times)} steps, "
                           f"{len(gens)} generations, {trainer.state.global_step} optimizer steps")
    if not all(b <= g0 and g1 <= e for (b, e), (g0, g1) in zip(timer.spans, gen_spans)):
        raise RuntimeError("a TRL generation ran outside the timed step")
    steps = [{"step_s": t, **g, "rollout_s": gt, "train_s": t - gt, "micro_steps": n, "optimizer_steps": 1}
             for t, g, gt, n in zip(timer.times, gens, gen_times, timer.micros)]
    return {"steps": steps, "settings": {
        "model_dtype": str(trainer.model.dtype), "bf16_autocast": bf16, "loss_type": args.loss_type,
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "generation_batch_size": args.generation_batch_size, "optimizer_steps": trainer.state.global_step}}


def run_side(a) -> None:
    import torch

    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory(prefix=f"bench_{a.side}_") as tmp:
        res = run_relayrl(a, tmp) if a.side == "relayrl" else run_trl(a, tmp, bf16=a.side == "trl_bf16")
    res["threads"] = torch.get_num_threads()
    res["peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, 3)  # Linux: KiB
    if a.device == "cuda":
        res["peak_gpu_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 3)
    _common.write_json(a.result_file, res)


# ---- driver ------------------------------------------------------------------------------------------------
def child(a, side: str, model: str, seed: int) -> dict:
    args = ["--side", side, "--model", model, "--prompts", str(a.prompts), "--group", str(a.group),
            "--max-new-tokens", str(a.max_new_tokens), "--temperature", str(a.temperature), "--steps", str(a.steps),
            "--seed", str(seed), "--threads", str(a.threads), "--trl-micro-batch", str(a.trl_micro_batch),
            "--relayrl-checkpointing", a.relayrl_checkpointing, "--device", a.device,
            *(["--fixed-length"] if a.fixed_length else [])]
    t0 = time.perf_counter()
    res = _common.run_child(__file__, args, f"side {side}",
                            {"TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": str(a.threads)})
    res["process_s"] = time.perf_counter() - t0
    return res


def summarize(a, runs: list[dict]) -> dict:
    measured = [s for r in runs for s in r["steps"][1:]]  # drop each subprocess's warm-up step
    med = statistics.median(s["step_s"] for s in measured)
    total_s = sum(s["step_s"] for s in measured)
    tokens = sum(s["gen_tokens"] for s in measured)
    out = {"step_s_median": med, "step_s_all": [s["step_s"] for s in measured],
           "warmup_step_s": [r["steps"][0]["step_s"] for r in runs],
           "samples_per_step": sorted({s["samples"] for r in runs for s in r["steps"]}),
           "samples_per_s": a.prompts * a.group / med,
           "mean_completion_tokens": tokens / sum(s["samples"] for s in measured),
           "max_completion_tokens": max(s["max_len"] for s in measured),
           "generated_tokens_per_s": tokens / total_s,
           "rollout_s_median": statistics.median(s["rollout_s"] for s in measured),
           "train_s_median": statistics.median(s["train_s"] for s in measured),
           # per measured step: the steps' prompts are the same on both sides, their answers' lengths are not
           "rollout_s_all": [s["rollout_s"] for s in measured], "train_s_all": [s["train_s"] for s in measured],
           "gen_tokens_all": [s["gen_tokens"] for s in measured],
           "reward_mean": statistics.fmean(s["reward_mean"] for s in measured),
           "optimizer_steps_per_step": sorted({s["optimizer_steps"] for r in runs for s in r["steps"]}),
           "threads": sorted({r["threads"] for r in runs}), "process_s": [r["process_s"] for r in runs],
           "peak_rss_gb": max(r.get("peak_rss_gb", 0.0) for r in runs),
           "peak_gpu_gb": max((r["peak_gpu_gb"] for r in runs if "peak_gpu_gb" in r), default=None),
           "settings": runs[0]["settings"], "prompts_sha_per_step": [s["prompts_sha"] for s in runs[0]["steps"]]}
    if "weight_sync_s" in measured[0]:
        out["weight_sync_s_median"] = statistics.median(s["weight_sync_s"] for s in measured)
    if "micro_steps" in measured[0]:
        out["micro_steps_per_step"] = sorted({s["micro_steps"] for s in measured})
    return out


def compare(a, runs: dict[str, list[dict]]) -> dict:
    """Per-side summaries of `runs` (one seed's, or every seed's pooled) and relayrl's ratios to TRL's sides."""
    metrics = {s: summarize(a, rs) for s, rs in runs.items()}
    ratio = lambda s: metrics["relayrl"]["samples_per_s"] / metrics[s]["samples_per_s"] if s in metrics else None
    trl_sides = [s for s in ("trl", "trl_bf16") if s in metrics]
    fastest = max(trl_sides, key=lambda s: metrics[s]["samples_per_s"], default=None)
    ours = "relayrl" in metrics
    ratios = {"relayrl_vs_trl_samples_per_s": ratio(fastest) if ours and fastest else None,
              "relayrl_vs_trl_fp32_samples_per_s": ratio("trl") if ours else None,
              "relayrl_vs_trl_bf16_samples_per_s": ratio("trl_bf16") if ours else None,
              "trl_reference_side": fastest,
              # per generated token: takes out the answers' lengths, which sampling sets differently per side
              "relayrl_vs_trl_generated_tokens_per_s": (metrics["relayrl"]["generated_tokens_per_s"]
                                                        / metrics[fastest]["generated_tokens_per_s"]
                                                        if ours and fastest else None)}
    shas = {s: m.pop("prompts_sha_per_step") for s, m in metrics.items()}
    return {"metrics": metrics, "ratios": ratios, "prompts_sha_per_step": shas,
            "same_prompts_every_step": len({json.dumps(v) for v in shas.values()}) == 1}


def over_seeds(per_seed: list[dict]) -> dict:
    """Each ratio seed by seed and its median: one seed's prompts and sampled lengths can favour either side, so
    the median over seeds is the reading to quote (the pooled ratio weighs seeds by their steps' times)."""
    out = {}
    for key in [k for k in per_seed[0] if k.endswith("_per_s")]:
        values = [r[key] for r in per_seed]
        if None not in values:
            out[f"{key}_by_seed"], out[f"{key}_median_over_seeds"] = values, statistics.median(values)
    return out


def main() -> None:
    a = parse_args()
    if a.side:
        return run_side(a)
    if any(s.startswith("trl") for s in a.sides) and importlib.util.find_spec("trl") is None:
        sys.exit("error: the trl sides need TRL: .venv/bin/pip install '.[bench]' (or --sides relayrl)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit(f"error: --device cuda, but torch {torch.__version__} sees no GPU (CUDA build: {torch.version.cuda})")
    from relayrl.models import resolve_model_path, tiny_model

    model = str(tiny_model()) if a.quick else resolve_model_path(a.model)
    load = _common.load_before_run()
    runs: dict[int, dict[str, list[dict]]] = {seed: {s: [] for s in a.sides} for seed in a.seeds}
    for seed in a.seeds:
        for r in range(a.rounds):
            for side in a.sides:
                print(f"[seed {seed}, round {r + 1}/{a.rounds}] {side} ...", file=sys.stderr, flush=True)
                runs[seed][side].append(child(a, side, model, seed))
    by_seed = {seed: compare(a, rs) for seed, rs in runs.items()}
    pooled = compare(a, {s: [r for rs in runs.values() for r in rs[s]] for s in a.sides})
    ratios = {**pooled["ratios"], **over_seeds([b["ratios"] for b in by_seed.values()])}
    result = {**_common.result_header("grpo_step_vs_trl"), "metrics": pooled["metrics"], "ratios": ratios,
              "by_seed": {str(seed): b for seed, b in by_seed.items()},
              "workload": {"model": model, "prompts": a.prompts, "group": a.group,
                           "samples_per_step": a.prompts * a.group, "max_new_tokens": a.max_new_tokens,
                           "temperature": a.temperature, "lr": LR,
                           "warmup_steps": 1, "measured_steps": a.steps, "rounds": a.rounds, "seeds": a.seeds,
                           "threads": a.threads, "device": a.device, "fixed_length": a.fixed_length,
                           "dataset": {"task": "basic_arithmetic", "seeds": a.seeds, **DATA_KW}},
              "checks": {"loadavg_1min_at_start": load,
                         "same_prompts_every_step": all(b["same_prompts_every_step"] for b in by_seed.values()),
                         "prompts_sha_per_step": {str(seed): b.pop("prompts_sha_per_step")
                                                  for seed, b in by_seed.items()}}}
    print(json.dumps(result, indent=2))
    _common.write_json(a.out, result)


if __name__ == "__main__":
    main()
