#!/usr/bin/env python
"""Cost as work grows: one colocated GRPO step at real model shapes (random weights), time and peak memory.

Sizes: SmolLM2-135M, SmolLM2-360M, Qwen2.5-0.5B and Qwen2.5-1.5B, built from their published configs (written
out below, no weights: random init, so nothing is downloaded). Each run is its own subprocess, so its peak RSS
(getrusage ru_maxrss) is its own, and is stepped the way relayrl.run.loop.train_steps steps a run:

- the run config is relayrl's defaults (relayrl.config.schema) with the model folder and the shape overridden,
  precision resolved by relayrl.run.resolve.resolve (engine.dtype auto -> bf16 where native, trainer fp32
  master weights with bf16 autocast iff the engine is bf16), the trainer built by relayrl.run.build._train_controller
  (TrainEngine + fused AdamW) and the engine by relayrl.run.build.make_engines (a LocalEngine on its own copy, or on
  the trainer's model when relayrl.run.build.shares_weights says so). Only load_model is replaced (in build, trainer
  and engine): it builds the model from config.json with random weights instead of reading safetensors;
- rollout: the LocalEngine generates prompts x group samples of exactly NEW_TOKENS tokens (ignore_eos) from
  random PROMPT_LEN-token prompts; the samples get random 0/1 rewards;
- train: the engine gives back its KV cache and weights (RolloutController.release_memory, as
  InProcessRollouts.release_memory does), TrainController.fit trains on the samples (one AdamW step), and the
  weight sync (RolloutController.load_weights of TrainController.weights()) restores the engine's weights.

--steps steps run (default 2: the first allocates the optimizer state and warms the kernels, and memory keeps
growing into the second); times are the last step's, the peak is the process's over all steps. The floor is
16 bytes/param: fp32 weights + fp32 gradients + AdamW's two fp32 moments. Parts of the peak are counted from the
objects (as `bench/memory.py parts` does); `activations` are the bytes autograd saves in the largest micro-batch (a
saved-tensors hook), of which `autocast_weight_copies` are the bf16 casts of the weights that autocast makes and
backward keeps; `unexplained_gb` is the peak minus what the training phase holds (allocator retention).

Every size runs in each --series: `default` (relayrl's defaults) and `gradient_checkpointing`
(model.gradient_checkpointing=true). A run whose estimated need exceeds the machine's RAM (MemTotal) is not run,
with the reason; nor is one that could fit but not now (MemAvailable: the machine is shared). A guard thread
ends a run that brings MemAvailable under 0.5 GB (recorded as an error), so the OOM killer never picks another
process.

The long-context case (--long-shape, default 2 prompts x 2 samples, 1024-token prompts and 1024 new tokens, the
135M shape) runs with train.micro_batch_tokens and model.gradient_checkpointing varied (--long-variants).
--malloc-experiment SIZE reruns SIZE's first --series with MALLOC_ARENA_MAX=2, with a fixed
MALLOC_MMAP_THRESHOLD_ (large blocks always mmap'd, so freed at once), with that plus transparent huge pages, and
with malloc_trim(0) between phases (--malloc-variants picks some of them).

    .venv/bin/python bench/scaling.py                     # full run (~1 h on 2 shared cores)
    .venv/bin/python bench/scaling.py --sizes smollm2-135m --no-long run.threads=1
    .venv/bin/python bench/scaling.py --quick             # tiny shapes, < 60 s, nothing recorded
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common
from _scaling_child import GB, MemGuard, meminfo, run_child

SERIES = {"default": [], "gradient_checkpointing": ["model.gradient_checkpointing=true"],
          # bf16 weights, gradients and moments (8 B/param), the other settings relayrl's defaults
          "bf16_weights": ["model.train_dtype=bfloat16"]}
MALLOC_VARIANTS = {  # name -> (environment, child option)
    "MALLOC_ARENA_MAX=2": ({"MALLOC_ARENA_MAX": "2"}, {}),
    "MALLOC_MMAP_THRESHOLD_=1MiB": ({"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}, {}),
    "malloc_trim_between_phases": ({}, {"malloc_trim": True}),
    # the same fixed threshold with transparent huge pages on the mappings, asked for by glibc (>= 2.35) or by
    # torch's allocator (tensors >= 2 MB): a fresh 2 MB page costs one fault where 4 KB pages cost 512
    "MALLOC_MMAP_THRESHOLD_=1MiB+glibc_THP": ({"MALLOC_MMAP_THRESHOLD_": str(1 << 20),
                                               "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, {}),
    "MALLOC_MMAP_THRESHOLD_=1MiB+torch_THP": ({"MALLOC_MMAP_THRESHOLD_": str(1 << 20),
                                               "THP_MEM_ALLOC_ENABLE": "1"}, {}),
}

# ---- the model shapes (published HF configs; only what differs from the transformers defaults matters) --------
_SMOL = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152, tie_word_embeddings=True,
             max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5, hidden_act="silu",
             attention_bias=False, mlp_bias=False, bos_token_id=1, eos_token_id=2, pad_token_id=2)
_QWEN = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=151936, tie_word_embeddings=True,
             max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6, hidden_act="silu",
             use_sliding_window=False, bos_token_id=151643, eos_token_id=151645, pad_token_id=151643)
# name -> (HF config, published parameter count as the model cards round it)
SIZES: dict[str, tuple[dict, str]] = {
    "smollm2-135m": ({**_SMOL, "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
                      "num_key_value_heads": 3, "intermediate_size": 1536}, "135M"),
    "smollm2-360m": ({**_SMOL, "hidden_size": 960, "num_hidden_layers": 32, "num_attention_heads": 15,
                      "num_key_value_heads": 5, "intermediate_size": 2560}, "362M"),
    "qwen2.5-0.5b": ({**_QWEN, "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
                      "num_key_value_heads": 2, "intermediate_size": 4864}, "494M"),
    "qwen2.5-1.5b": ({**_QWEN, "hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12,
                      "num_key_value_heads": 2, "intermediate_size": 8960}, "1.54B"),
}
_TINY = dict(_SMOL, vocab_size=2048, max_position_embeddings=1024)
QUICK_SIZES: dict[str, tuple[dict, str]] = {
    "tiny-a": ({**_TINY, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "intermediate_size": 128}, "0.205M"),
    "tiny-b": ({**_TINY, "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
                "num_key_value_heads": 2, "intermediate_size": 256}, "0.853M"),
    # never fits: exercises the "not run" path without building anything
    "qwen2.5-1.5b": SIZES["qwen2.5-1.5b"],
}

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=",".join(SIZES), help="comma-separated sizes to run: " + ", ".join(SIZES))
    p.add_argument("--series", default=",".join(SERIES), help="comma-separated: " + ", ".join(SERIES))
    p.add_argument("--shape", default="8x8x64x128",
                   help="PROMPTSxGROUPxPROMPT_LENxNEW_TOKENS of the per-size step (64 samples of 64+128 tokens)")
    p.add_argument("--steps", type=int, default=2, help="GRPO steps per run (the last is timed; 1st = warm-up)")
    p.add_argument("--long", action=argparse.BooleanOptionalAction, default=True, help="run the long-context case")
    p.add_argument("--long-size", default="smollm2-135m")
    p.add_argument("--long-shape", default="2x2x1024x1024", help="PROMPTSxGROUPxPROMPT_LENxNEW_TOKENS")
    p.add_argument("--long-variants", default="4096:off,4096:on,2048:off,8192:off",
                   help="MICRO_BATCH_TOKENS:GRADIENT_CHECKPOINTING pairs for the long-context case")
    p.add_argument("--malloc-experiment", default="smollm2-135m",
                   help="comma-separated sizes rerun with the allocator variants ('' for none)")
    p.add_argument("--malloc-variants", default=",".join(MALLOC_VARIANTS),
                   help="comma-separated allocator variants: " + ", ".join(MALLOC_VARIANTS))
    p.add_argument("--mem-margin-gb", type=float, default=1.0,
                   help="keep this much of MemAvailable free when deciding whether a run can start")
    p.add_argument("--timeout", type=int, default=3600, help="seconds per subprocess")
    p.add_argument("--out", help="result file (default bench/results/scaling.json; --quick: a temp file)")
    p.add_argument("--plot", help="plot file (default docs/img/scaling.png; --quick: a temp file)")
    p.add_argument("--quick", action="store_true", help="tiny shapes, 1 step, < 60 s, nothing recorded")
    p.add_argument("--replot", action="store_true", help="only redraw --plot from the --out result file")
    p.add_argument("--plot-also", action="append", default=[], metavar="RESULT_JSON",
                   help="more result files whose series the plot shows too (e.g. a run with MALLOC_ settings)")
    p.add_argument("overrides", nargs="*", help="config overrides for every run, e.g. run.threads=1")
    p.add_argument("--child", help=argparse.SUPPRESS)  # JSON spec of one run (internal)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.quick:
        a.sizes, a.series, a.shape, a.steps = "tiny-a,tiny-b,qwen2.5-1.5b", "default", "2x2x16x16", 1
        a.long_size, a.long_shape, a.long_variants = "tiny-a", "1x2x32x32", "64:on"
        a.malloc_experiment = ""
    tmp = tempfile.gettempdir()
    a.out = a.out or (os.path.join(tmp, "scaling_quick.json") if a.quick else "bench/results/scaling.json")
    a.plot = a.plot or (os.path.join(tmp, "scaling_quick.png") if a.quick else "docs/img/scaling.png")
    return a


def parse_shape(text: str) -> dict:
    prompts, group, prompt_len, new_tokens = (int(x) for x in text.lower().split("x"))
    return {"prompts": prompts, "group": group, "prompt_len": prompt_len, "new_tokens": new_tokens}


def size_table(quick: bool) -> dict[str, tuple[dict, str]]:
    return QUICK_SIZES if quick else SIZES


# ---- the model sizes ------------------------------------------------------------------------------------------
def count_params(hf_config: dict) -> int:
    """Parameters of the model a config describes (built on the meta device: no memory, no time)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**hf_config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


def published(text: str) -> float:
    return float(text[:-1]) * {"M": 1e6, "B": 1e9}[text[-1]]


def memory_estimate(hf_config: dict, params: int, shape: dict, micro_batch_tokens: int, checkpointing: bool,
                    bytes_per_param: int = 16) -> dict:
    """What a step's training phase holds at least, in bytes: ~0.5 GB of runtime, the floor (`bytes_per_param`: 16,
    or 8 with bf16 weights), the bf16 autocast weight copies backward keeps (2 B/param, none for bf16 weights;
    recomputed per layer under checkpointing) and one
    micro-batch's activations. Activations per token and layer are ~40*hidden + 6*intermediate bytes with bf16
    autocast (measured on the 135M shape: HF's fp32 residual/RMSNorm tensors and the bf16 matmul inputs and MLP
    intermediates); checkpointing keeps only each layer's fp32 input plus one layer's worth. Allocator retention
    comes on top (see `unexplained_gb`). The rollout phase (14 B/param + KV cache) holds less."""
    h, inter, layers = hf_config["hidden_size"], hf_config["intermediate_size"], hf_config["num_hidden_layers"]
    tokens = min(micro_batch_tokens, shape["prompts"] * (shape["prompt_len"] + shape["group"] * shape["new_tokens"]))
    per_layer = tokens * (40 * h + 6 * inter)
    copies = 0 if checkpointing or bytes_per_param < 16 else 2 * params
    parts = {"runtime": 0.5 * GB, "floor": bytes_per_param * params, "autocast_weight_copies": copies,
             "activations": tokens * 4 * h * layers + per_layer if checkpointing else per_layer * layers}
    return {"total": sum(parts.values()), **parts}


# ---- the parent: plan, run, summarize ---------------------------------------------------------------------------
def run_spec(a, spec: dict, env_extra: dict | None = None) -> dict:
    """Run one spec in a subprocess; a failure is returned as {"error": ...}, never raised."""
    with tempfile.TemporaryDirectory(prefix="bench_scaling_res_") as d:
        out = os.path.join(d, "result.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec), "--result-file", out]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore",
               **(env_extra or {})}
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, cwd=_common.REPO, stdout=sys.stderr, timeout=a.timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {a.timeout} s"}
        if proc.returncode == MemGuard.EXIT:
            return {"error": f"stopped by the memory guard: MemAvailable fell under {spec['guard_gb']} GB"}
        if proc.returncode:
            return {"error": f"subprocess failed with exit code {proc.returncode}"}
        res = json.loads(Path(out).read_text())
        res["process_s"] = time.perf_counter() - t0
        return res


def make_spec(a, hf_config: dict, shape: dict, overrides: list[str], **extra) -> dict:
    return {"hf_config": hf_config, "shape": shape, "steps": a.steps, "overrides": [*a.overrides, *overrides],
            "guard_gb": 0.5, **extra}


def run_config(a, overrides: list[str]):
    """The resolved relayrl config a run will use (for the estimate: micro-batch size, checkpointing)."""
    from relayrl.config.schema import load_run_config
    from relayrl.run.resolve import resolve

    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "config.json").write_text("{}")
        return resolve(load_run_config(None, [f"model.path={tmp}", *a.overrides, *overrides]), quiet=True)


def plan(a, hf_config: dict, params: int, shape: dict, overrides: list[str], mem_total: int) -> dict:
    """The memory estimate of a run and, when it cannot run, why."""
    from relayrl.common.memory import checkpointing_on

    cfg = run_config(a, overrides)
    per_param = 8 if cfg.model.train_dtype == "bfloat16" else 16  # relayrl.common.memory.training_floor
    gc = checkpointing_on(cfg.model.gradient_checkpointing, per_param * params, mem_total)  # as the trainer will
    est = memory_estimate(hf_config, params, shape, cfg.train.micro_batch_tokens, gc, per_param)
    avail = meminfo()["MemAvailable"]
    out = {"estimated_need_gb": {k: round(v / GB, 2) for k, v in est.items()}, "mem_available_gb": avail / GB}
    need = est["total"]
    if need > 0.95 * mem_total:  # the kernel and page tables need some of MemTotal too
        half = f"; with bf16 weights, gradients and moments (--series bf16_weights, 8 B/param) it needs ~" \
               f"{(need - est['floor'] / 2) / GB:.1f} GB" if per_param == 16 else ""
        out["not_run"] = (f"the {per_param} B/param floor alone is {est['floor'] / GB:.1f} GB; with the runtime, "
                          f"{'' if gc else 'bf16 weight copies and '}activations a step "
                          f"needs ~{need / GB:.1f} GB, more than this machine can hold ({mem_total / GB:.1f} GB of "
                          f"RAM, no swap){half}")
    elif need > avail - a.mem_margin_gb * GB:
        out["not_run"] = (f"needs ~{need / GB:.1f} GB (activations of a {cfg.train.micro_batch_tokens}-token "
                          f"micro-batch: {est['activations'] / GB:.1f} GB); MemAvailable is {avail / GB:.1f} GB now: "
                          f"other processes hold the rest of the {mem_total / GB:.1f} GB")
    return out


def loglog_slope(xs: list[float], ys: list[float]) -> float | None:
    if len(xs) < 2:
        return None
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((x - mx) * (y - my) for x, y in zip(lx, ly)) / sum((x - mx) ** 2 for x in lx)


def series_runs(sizes: dict, series: str) -> dict[str, dict]:
    return {k: v["series"][series] for k, v in sizes.items() if "peak_rss_gb" in v["series"].get(series, {})}


def goals(sizes: dict, series_names: list[str]) -> dict:
    """Per series: peak within 1.5x of the floor at every size that ran, and step time ~ params (log-log slope
    of time over params within 0.8-1.2)."""
    out = {}
    for series in series_names:
        ran = series_runs(sizes, series)
        mem = {k: round(v["peak_over_floor"], 2) for k, v in ran.items()}
        not_run = {k: v["series"][series].get("not_run") or v["series"][series].get("error")
                   for k, v in sizes.items() if k not in ran and series in v["series"]}
        xs = [v["params"] for v in ran.values()]
        g = {"memory_within_1.5x_floor": {"met": bool(mem) and all(r <= 1.5 for r in mem.values()),
                                          "peak_over_floor": mem, "not_run": not_run}}
        t = {}
        for key in ("step_s", "rollout_s", "train_s"):
            t[f"{key}_loglog_slope"] = loglog_slope(xs, [v[key] for v in ran.values()])
            t[f"{key}_per_B_params"] = {k: v[key] / (v["params"] / 1e9) for k, v in ran.items()}
        slope = t["step_s_loglog_slope"]
        t["met"] = None if slope is None else 0.8 <= slope <= 1.2
        g["time_roughly_linear_in_params"] = t
        out[series] = g
    return out


def _env_label(sizes: dict, series: str) -> str:
    """' + MALLOC_X=..' when a result file's runs had allocator settings in their environment."""
    env = next((v.get("settings", {}).get("malloc_env") for v in series_runs(sizes, series).values()), None)
    return "".join(f" + {k}={v}" for k, v in (env or {}).items())


def plot(res: dict, path: str, also: list[dict] = ()) -> None:
    """Step time and peak RSS against parameters, one line per series of `res` and of each result in `also`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = res["sizes"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    colors = iter(["tab:red", "tab:blue", "tab:green", "tab:purple", "tab:orange"])
    lines = [(r["sizes"], s) for r in (res, *also) for s in r["workload"]["series"]]
    for sizes_of, series in lines:
        ran = series_runs(sizes_of, series)
        if not ran:
            continue
        series = f"{series}{_env_label(sizes_of, series)}"
        xs = [v["params"] / 1e9 for v in ran.values()]
        c = next(colors, "tab:gray")
        ax1.plot(xs, [v["step_s"] for v in ran.values()], "o-", color=c, label=f"{series}: step")
        ax1.plot(xs, [v["train_s"] for v in ran.values()], "^--", color=c, alpha=0.6, label=f"{series}: train")
        ax1.plot(xs, [v["rollout_s"] for v in ran.values()], "v:", color=c, alpha=0.6, label=f"{series}: rollout")
        ax2.plot(xs, [v["peak_rss_gb"] for v in ran.values()], "o-", color=c, label=f"{series}: peak RSS")
        for v in ran.values():
            ax2.annotate(f"{v['peak_over_floor']:.2f}x", (v["params"] / 1e9, v["peak_rss_gb"]), fontsize=8,
                         textcoords="offset points", xytext=(4, 4), color=c)
    all_x = [v["params"] / 1e9 for v in sizes.values()]
    line = [0, max(all_x)] if all_x else []
    ax2.plot(line, [16 * x for x in line], "--", color="black", label="16 B/param floor")
    ax2.plot(line, [24 * x for x in line], ":", color="black", label="1.5x floor")
    for k, v in sizes.items():
        if all("not_run" in r for r in v["series"].values()):
            ax2.plot([v["params"] / 1e9], [v["floor_gb"]], "x", color="black", markersize=10,
                     label=f"{k}: not run (floor)")
    ax2.axhline(res["mem_total_gb"], color="gray", alpha=0.6, label=f"machine RAM {res['mem_total_gb']:.1f} GB")
    ax1.set(xlabel="parameters (B)", ylabel="seconds", title=f"one GRPO step ({res['workload']['shape_str']})")
    ax2.set(xlabel="parameters (B)", ylabel="GB", title="peak RSS of the step's process")
    ax1.set_ylim(0, ax1.get_ylim()[1] * 1.8)  # room for the legend above the lines
    for ax in (ax1, ax2):
        ax.legend(fontsize=7, loc="upper left")
        ax.grid(alpha=0.3)
    m = res["machine"]
    fig.suptitle(f"relayrl scaling: {m.get('cpu_model', '?')}, {m.get('cores')} cores "
                 f"({m.get('torch_cpu_capability')}), {res['date'][:10]}, {' '.join(res['workload']['overrides'])}",
                 fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{path}.tmp.png"
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)


def brief(r: dict) -> str:
    if "error" in r or "not_run" in r:
        return f"ERROR {r['error']}" if "error" in r else f"not run: {r['not_run']}"
    own = (f", {r['peak_over_own_floor']:.2f}x its own floor {r['own_floor_gb']:.2f}"
           if r.get("own_floor_gb", r["floor_gb"]) != r["floor_gb"] else "")
    return (f"peak {r['peak_rss_gb']:.2f} GB ({r['peak_over_floor']:.2f}x floor {r['floor_gb']:.2f}{own}), "
            f"step {r['step_s']:.1f}s = rollout {r['rollout_s']:.1f} + train {r['train_s']:.1f}, "
            f"{r['tokens_per_s']:.0f} tok/s")


def run_planned(a, label: str, hf_config: dict, params: int, shape: dict, overrides: list[str], mem_total: int,
                env: dict | None = None, **extra) -> dict:
    r = plan(a, hf_config, params, shape, overrides, mem_total)
    if "not_run" not in r:
        r["load_before"] = _common.load_before_run()
        r |= run_spec(a, make_spec(a, hf_config, shape, overrides, **extra), env)
    print(f"[{label}] {brief(r)}", file=sys.stderr, flush=True)
    return r


def save_partial(a, res: dict) -> None:
    """The result so far, marked incomplete: a long run that is cut short keeps what it measured."""
    _common.write_json(a.out, {**res, "complete": False})


def main() -> None:
    a = parse_args()
    if a.child:
        _common.write_json(a.result_file, run_child(json.loads(a.child)))
        return
    also = [json.loads(Path(f).read_text()) for f in a.plot_also]
    if a.replot:
        plot(json.loads(Path(a.out).read_text()), a.plot, also)
        print(f"wrote {a.plot}", file=sys.stderr)
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    table = size_table(a.quick)
    names = [s for s in a.sizes.split(",") if s]
    series = [s for s in a.series.split(",") if s]
    variants = [v for v in a.malloc_variants.split(",") if v]
    if unknown := ([s for s in names if s not in table] + [s for s in series if s not in SERIES]
                   + [v for v in variants if v not in MALLOC_VARIANTS]):
        raise SystemExit(f"unknown sizes, series or malloc variants {unknown}; sizes: {list(table)}, "
                         f"series: {list(SERIES)}, variants: {list(MALLOC_VARIANTS)}")
    shape, long_shape = parse_shape(a.shape), parse_shape(a.long_shape)
    mem_total = meminfo()["MemTotal"]
    res = {**_common.result_header("scaling"), "mem_total_gb": mem_total / GB,
           "workload": {"shape_str": f"{shape['prompts']} prompts x {shape['group']} samples, "
                                     f"{shape['prompt_len']}+{shape['new_tokens']} tokens",
                        **shape, "steps": a.steps, "series": series, "overrides": a.overrides, "quick": a.quick},
           "sizes": {}}
    for name in names:
        hf_config, label = table[name]
        n = count_params(hf_config)
        pub = published(label)
        entry = res["sizes"][name] = {"params": n, "published": label,
                                      "params_match_published": abs(n - pub) / pub < 0.01, "floor_gb": 16 * n / GB,
                                      "series": {}}
        print(f"[{name}] {n:,} params (published {label}: {'match' if entry['params_match_published'] else 'MISMATCH'}"
              f"), floor {entry['floor_gb']:.2f} GB", file=sys.stderr, flush=True)
        for s in series:
            entry["series"][s] = run_planned(a, f"{name} {s}", hf_config, n, shape, SERIES[s], mem_total)
            save_partial(a, res)
    for name in (s for s in a.malloc_experiment.split(",") if s):
        hf_config, _ = table[name]
        n = count_params(hf_config)
        exp = res.setdefault("malloc_experiments", {})[name] = {"series": series[0]}
        for key in variants:
            env, extra = MALLOC_VARIANTS[key]
            exp[key] = run_planned(a, f"malloc {name} {key}", hf_config, n, shape, SERIES[series[0]], mem_total,
                                   env, **extra)
            save_partial(a, res)
    if a.long:
        hf_config, _ = table[a.long_size]
        n = count_params(hf_config)
        res["long_context"] = {"size": a.long_size, **long_shape, "variants": {}}
        for variant in a.long_variants.split(","):
            mbt, gc = variant.split(":")
            key = f"micro_batch_tokens={mbt},gradient_checkpointing={gc}"
            over = [f"train.micro_batch_tokens={mbt}", f"model.gradient_checkpointing={gc == 'on'}"]
            res["long_context"]["variants"][key] = run_planned(a, f"long {key}", hf_config, n, long_shape, over,
                                                               mem_total)
            save_partial(a, res)
    res["goals"] = goals(res["sizes"], series)
    res["complete"] = True
    print(json.dumps(res, indent=2))
    _common.write_json(a.out, res)
    if res["sizes"]:
        plot(res, a.plot, also)
    print(f"wrote {a.out}" + (f" and {a.plot}" if res["sizes"] else ""), file=sys.stderr)


if __name__ == "__main__":
    main()
