"""The README job's fit under settings, profiled, and random-weight model folders (`bench/train.py
train_settings|fit_profile|random_model`). Each function named after its command is that command."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import _common

TRAIN = Path(__file__).with_name("train.py")  # the script these commands run under (and their children)
DEFAULT_SIDES = ["shipped=",
                 "no_gc_256=model.gradient_checkpointing=false,train.micro_batch_tokens=256",
                 "no_gc_512=model.gradient_checkpointing=false,train.micro_batch_tokens=512"]
PEAK_SHAPE = (1024, 576, 1536)  # [rows x in] @ [in x out]: an MLP up-projection of SmolLM2-135M in training
MATMUL = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}
ATTENTION = ("_SegmentKernel", "_SegmentKernelBackward", "aten::_scaled_dot_product", "aten::scaled_dot_product")
COPIES = {"aten::copy_", "aten::_to_copy", "aten::clone", "aten::contiguous", "aten::index_select", "aten::cat"}
ELEMENTWISE = {"aten::mul", "aten::mul_", "aten::add", "aten::add_", "aten::sub", "aten::sub_", "aten::div",
               "aten::neg", "aten::pow", "aten::rsqrt", "aten::mean", "aten::sum", "aten::silu", "aten::silu_backward",
               "aten::exp", "aten::exp_", "aten::fill_", "aten::zero_", "aten::amax", "aten::log", "aten::where"}
RANDOM_MARK = "RANDOM_WEIGHTS"  # a file in the folder: says what the weights are to people and scripts
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "generation_config.json")


# ---- train_settings --------------------------------------------------------------------------------------------
def settings_args(argv: list[str]) -> argparse.Namespace:
    p = _common.parser("train_settings", train_settings.__doc__)
    p.add_argument("--config", default="examples/arithmetic_grpo.yaml")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="alternating runs of every side")
    p.add_argument("--side", action="append", dest="sides",
                   help="NAME=key=value,key=value (repeatable; default: shipped, no_gc_256, no_gc_512)")
    p.add_argument("--cpu", choices=["native", "avx2"], default="native")
    p.add_argument("--out", default=None, help="default bench/results/train_settings[_avx2].json")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.sides = a.sides or DEFAULT_SIDES
    for spec in a.sides:
        if "=" not in spec:
            p.error(f"--side {spec!r}: expected NAME=key=value,... (NAME= for the config as shipped)")
    a.out = a.out or f"bench/results/train_settings{'_avx2' if a.cpu == 'avx2' else ''}.json"
    return a


def split_side(spec: str) -> tuple[str, list[str]]:
    name, _, overrides = spec.partition("=")
    return name, [o for o in overrides.split(",") if o]


def _vm_gb(key: str) -> float:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key))
    return int(line.split()[1]) * 1024 / 1e9


def settings_side(a) -> dict:
    import relayrl.run.loop  # noqa: F401 - everything the CLI imports
    from relayrl.common.memory import trim_memory, tune_allocator
    from relayrl.config.schema import load_run_config
    from relayrl.run.build import build

    name, overrides = split_side(a.child)
    env = dict(o[len("env."):].split("=", 1) for o in overrides if o.startswith("env."))
    os.environ.update(env)
    overrides = [o for o in overrides if not o.startswith("env.")]
    tune_allocator()
    fit_s, peaks, tokens = [], [], []
    with tempfile.TemporaryDirectory(prefix="bench_settings_") as tmp:
        cfg = load_run_config(a.config, [f"run.output_dir={tmp}", "run.tensorboard=false", "eval.at_start=false",
                                         "eval.at_end=false", f"run.steps={a.steps}", "run.print_samples=0",
                                         *overrides])
        c = build(cfg)
        try:
            for _ in range(a.steps):
                batch, _ = c.rollouts.next_batch(c.train_ctl.version)
                c.rollouts.release_memory()
                trim_memory()
                Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts from RSS now
                t0 = time.perf_counter()
                metrics = c.train_ctl.fit(batch)
                fit_s.append(round(time.perf_counter() - t0, 2))
                peaks.append(round(_vm_gb("VmHWM"), 3))
                tokens.append(int(metrics.get("train/tokens", 0)))
                c.rollouts.load_weights(c.train_ctl.weights())
                trim_memory()
        finally:
            c.close()
    return {"side": name, "overrides": overrides, "env": env, "fit_s": fit_s, "train_peak_gb": peaks,
            "trained_tokens": tokens}


def summarize(runs: list[dict], names: list[str]) -> dict:
    """Per side: median fit time of step 1 (the same batch on every side) and of all steps, max training peak."""
    out = {}
    for name in names:
        mine = [r for r in runs if r["side"] == name]
        out[name] = {"first_fit_s_median": statistics.median(r["fit_s"][0] for r in mine),
                     "fit_s_median": statistics.median(t for r in mine for t in r["fit_s"]),
                     "train_peak_gb_max": max(p for r in mine for p in r["train_peak_gb"]),
                     "overrides": mine[0]["overrides"], "env": mine[0].get("env", {})}
    base = out[names[0]]
    for name in names[1:]:
        out[name]["first_fit_vs_" + names[0]] = round(out[name]["first_fit_s_median"] / base["first_fit_s_median"], 3)
    return out


def settings_child(spec: str, a) -> dict:
    args = ["train_settings", "--child", spec, "--config", a.config, "--steps", str(a.steps)]
    return _common.run_child(str(TRAIN), args, f"side {spec!r}", _common.AVX2_ENV if a.cpu == "avx2" else None)


def train_settings(argv: list[str]) -> None:
    """The README job's training phase under different train settings, side by side: fit time and peak memory.

    Each side is a named list of config overrides (e.g. gradient checkpointing on or off, the micro-batch size).
    A side runs in its own child process, which builds the run from examples/arithmetic_grpo.yaml plus the side's
    overrides and steps it as relayrl.run.loop.train_steps does (rollout, release the engine's memory, fit,
    weight sync). It records each fit's wall time and the process's high-water mark during the fits only (VmHWM,
    reset before each fit by writing 5 to /proc/self/clear_refs). Sides alternate round by round; every side
    starts from the same weights, data and seeds, so the first step fits the same batch on every side.
    An override `env.NAME=VALUE` sets an environment variable in that side's child instead of a config key.

        .venv/bin/python bench/train.py train_settings             # shipped vs no checkpointing at 256/512 tokens
        .venv/bin/python bench/train.py train_settings --cpu avx2  # as on an AVX2-only CPU (bench/_common.AVX2_ENV)
        .venv/bin/python bench/train.py train_settings --side 'small=train.micro_batch_tokens=512' --side 'shipped='
        .venv/bin/python bench/train.py train_settings --side kernel= \\
            --side 'torch=env.RELAYRL_KERNELS_OFF=segment_attention'
    """
    a = settings_args(argv)
    if a.child:
        _common.write_json(a.result_file, settings_side(a))
        return
    load = _common.load_before_run()
    names = [split_side(s)[0] for s in a.sides]
    runs = [settings_child(spec, a) for _ in range(a.rounds) for spec in a.sides]
    summary = summarize(runs, names)
    result = _common.result_header("train_settings") | {
        "load_before": load, "cpu": a.cpu, "env": _common.AVX2_ENV if a.cpu == "avx2" else {},
        "config": a.config, "steps": a.steps, "rounds": a.rounds, "summary": summary, "runs": runs}
    _common.write_json(a.out, result)
    print(json.dumps(summary, indent=1))


# ---- fit_profile -----------------------------------------------------------------------------------------------
def category(name: str) -> str:
    if name in MATMUL:
        return "matmul"
    if name.startswith(ATTENTION):
        return "attention"
    if name in COPIES:
        return "casts_copies"
    if name in ELEMENTWISE:
        return "elementwise"
    if name.startswith("Optimizer.step"):
        return "optimizer"
    return "other"


def profile_fit(overrides: list[str]) -> dict:
    from kernels import matmul_measure
    from torch.profiler import ProfilerActivity, profile

    import relayrl.run.loop  # noqa: F401 - everything the CLI imports
    from relayrl.common.memory import trim_memory, tune_allocator
    from relayrl.config.schema import load_run_config
    from relayrl.run.build import build

    tune_allocator()
    with tempfile.TemporaryDirectory(prefix="bench_fit_profile_") as tmp:
        cfg = load_run_config("examples/arithmetic_grpo.yaml",
                              [f"run.output_dir={tmp}", "run.tensorboard=false", "eval.at_start=false",
                               "eval.at_end=false", "run.print_samples=0", *overrides])
        c = build(cfg)
        try:
            batch, _ = c.rollouts.next_batch(c.train_ctl.version)
            c.rollouts.release_memory()
            trim_memory()
            t0 = time.perf_counter()
            metrics = c.train_ctl.fit(batch)
            plain_s = time.perf_counter() - t0
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t0 = time.perf_counter()
                c.train_ctl.fit(batch)
                profiled_s = time.perf_counter() - t0
            with profile(activities=[ProfilerActivity.CPU], with_flops=True) as counted:  # FLOP counting costs time
                c.train_ctl.fit(batch)
            settings = {"autocast_bf16": c.train_ctl.engine.autocast_bf16,
                        "gradient_checkpointing": cfg.model.gradient_checkpointing,
                        "micro_batch_tokens": cfg.train.micro_batch_tokens,
                        "max_new_tokens": cfg.sampling.max_new_tokens,
                        "trained_tokens": int(metrics.get("train/tokens", 0)), "samples": len(batch)}
        finally:
            c.close()
    by_cat, ops = defaultdict(float), []
    for e in prof.key_averages():
        s = e.self_cpu_time_total / 1e6
        by_cat[category(e.key)] += s
        ops.append((s, e.key, e.count))
    flops = sum(e.flops or 0 for e in counted.key_averages() if e.key in MATMUL)
    mm_s = by_cat["matmul"]
    peak = matmul_measure("bfloat16" if settings["autocast_bf16"] else "float32", repeats=7,
                          shapes=[PEAK_SHAPE])[0]["gflops"]
    total = sum(by_cat.values())
    return {"settings": settings, "overrides": overrides, "fit_s": round(plain_s, 2),
            "profiled_fit_s": round(profiled_s, 2), "self_s_total": round(total, 2),
            "self_s": {k: round(v, 2) for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
            "self_share": {k: round(v / total, 3) for k, v in by_cat.items()},
            "matmul_gflop": round(flops / 1e9, 3), "matmul_gflops_in_fit": round(flops / mm_s / 1e9, 1),
            "matmul_gflops_alone": round(peak, 1), "floor_s_matmuls_at_rate_alone": round(flops / peak / 1e9, 2),
            "top_ops": [{"op": k, "self_s": round(s, 3), "calls": n} for s, k, n in sorted(ops, reverse=True)[:25]]}


def fit_profile(argv: list[str]) -> None:
    """Where one training fit's time goes: its matmuls' arithmetic rate against this machine's, and the rest by kind.

    Why: the train phase is most of relayrl's GRPO step (docs/benchmarks.md, "Speed: one GRPO step"). This builds the
    README job (examples/arithmetic_grpo.yaml plus overrides), rolls out one batch, fits it once plainly (timed),
    again under torch.profiler, and a third time to count the matmuls' FLOPs (counting slows the small ops); groups
    the profiled fit's self times (matmuls, attention, casts and copies, elementwise and the rest) and sets the
    matmuls' FLOPs against this machine's matmul rate at a training shape (bench/kernels.py's matmul_measure): the
    fit's floor at these settings is the matmul FLOPs at that rate.

        HF_HUB_OFFLINE=1 .venv/bin/python bench/train.py fit_profile sampling.max_new_tokens=128  # GRPO bench's
        HF_HUB_OFFLINE=1 .venv/bin/python bench/train.py fit_profile --out /tmp/p.json \\
            model.gradient_checkpointing=false
        .venv/bin/python bench/train.py fit_profile --quick     # smoke run on the tiny random model (seconds)
    """
    p = _common.parser("fit_profile", fit_profile.__doc__)
    p.add_argument("--out", default=None, help="default bench/results/fit_profile.json (--quick: a temp file)")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny model in fp32, 2x2, 10 new tokens")
    p.add_argument("overrides", nargs="*", help="config overrides on examples/arithmetic_grpo.yaml")
    a = p.parse_args(argv)
    if a.quick:
        from relayrl.models import tiny_model

        a.overrides = [f"model.path={tiny_model()}", "engine.dtype=float32", "model.autocast_bf16=false",
                       "data.batch_size=2", "data.group_size=2", "sampling.max_new_tokens=10", *a.overrides]
    a.out = a.out or (os.path.join(tempfile.gettempdir(), "fit_profile_quick.json") if a.quick
                      else "bench/results/fit_profile.json")
    out = _common.result_header("fit_profile") | {"load_1min_at_start": _common.load_before_run()}
    out |= profile_fit(a.overrides)
    _common.write_json(a.out, out)
    print({k: out[k] for k in ("fit_s", "self_s", "matmul_gflops_in_fit", "matmul_gflops_alone",
                               "floor_s_matmuls_at_rate_alone")})


# ---- random_model ----------------------------------------------------------------------------------------------
def build_random_model(shape: str, tokenizer: Path, out: Path, seed: int = 0) -> Path:
    """Save a random-init model of `shape` in fp32 safetensors plus `tokenizer`'s files, atomically (temp + rename)."""
    import torch
    from scaling import QUICK_SIZES, SIZES
    from transformers import AutoConfig, AutoModelForCausalLM

    from relayrl.models.store import atomic_build

    if not (tokenizer / "tokenizer.json").is_file():
        sys.exit(f"random_model: {tokenizer} has no tokenizer.json")
    hf_config = dict({**SIZES, **QUICK_SIZES}[shape][0])

    def write(tmp: Path) -> None:
        config = AutoConfig.for_model(**hf_config)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(tmp)
        for name in TOKENIZER_FILES:
            if (tokenizer / name).is_file():
                shutil.copy2(tokenizer / name, tmp / name)
        (tmp / RANDOM_MARK).write_text("random-init weights: they never learn (scripts/gpu_check.sh skips learning)\n")

    return atomic_build(out, write)


def random_model(argv: list[str]) -> None:
    """Write a model folder with a real model's shape and tokenizer but random weights (seeded), for benches on a
    machine the real weights cannot reach: the GPU machine gets the repository and a few MB beside it, not 270 MB of
    SmolLM2.

    Compute and memory per token depend on the shape alone, so step times and peaks measured on such a folder are the
    real model's; what it generates is not (random weights rarely emit EOS, so rollouts run to max_new_tokens). The
    shapes are bench/scaling.py's SIZES (published configs); the tokenizer folder is any HF folder whose tokenizer
    files are copied (the prepared SmolLM2 folder, or a copy of its tokenizer files).

        .venv/bin/python bench/train.py random_model --shape smollm2-135m \\
            --tokenizer ~/.cache/relayrl/models/SmolLM2-135M-Instruct --out /tmp/smollm2-random
    """
    from scaling import QUICK_SIZES, SIZES

    p = _common.parser("random_model", random_model.__doc__)
    p.add_argument("--shape", required=True, choices=sorted({**SIZES, **QUICK_SIZES}))
    p.add_argument("--tokenizer", required=True, help="folder holding tokenizer.json (and its config/template)")
    p.add_argument("--out", required=True, help="folder to write (must not exist)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    out = Path(a.out).expanduser().resolve()
    if out.exists():
        sys.exit(f"random_model: {out} exists; give a new folder")
    path = build_random_model(a.shape, Path(a.tokenizer).expanduser(), out, a.seed)
    print(f"random_model: {a.shape} with random weights (seed {a.seed}) written to {path}")
