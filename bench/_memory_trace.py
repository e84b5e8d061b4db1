"""Resident memory followed through training (`bench/memory.py step_memory|train_memory_trace|backward_peak`): step
by step through a real `relayrl train`, micro-batch by micro-batch with and without the heap trims, and part by part
of a micro-batch's backward. Each function named after its command is that command."""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
import types
from collections import Counter
from pathlib import Path

import _common

MEMORY = Path(__file__).with_name("memory.py")  # the script these commands run under (and their children)
RECORDED_ENV = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY", "RELAYRL_MMAP_THRESHOLD",
                "RELAYRL_MALLOC_ARENAS", "MALLOC_ARENA_MAX", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
TRACE_SIDES = ("trim", "no_trim")


# ---- step_memory -----------------------------------------------------------------------------------------------
def live_tensor_gb() -> dict[str, float]:
    """Bytes of the CPU tensor storages alive now, by dtype (each storage once, however many views share it)."""
    import torch

    seen, by_dtype = set(), Counter()
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                by_dtype[str(obj.dtype).removeprefix("torch.")] += storage.nbytes()
    return {k: v / 1e9 for k, v in by_dtype.items() if v}


def step_memory(argv: list[str]) -> None:
    """Memory step by step through a real `relayrl train`: where a run's resident memory goes and whether it grows.

    Runs the CLI in this process (arguments after `--` are `relayrl train`'s) and, after each step, records the
    step's time, RSS now and its high-water mark, glibc's heap (bytes in use, free inside the heap, mapped apart)
    and the bytes of live CPU tensors by dtype (found through the garbage collector). A heap in use that climbs
    while live tensors stay flat is memory held outside tensors: that is how the bf16 kernel caches were found
    (docs/benchmarks.md, "bf16 autocast by default where it is native"). Environment variables that change what
    is measured (oneDNN's cache capacities, the allocator settings) are recorded with the rows.

        .venv/bin/python bench/memory.py step_memory --out bench/results/step_memory.json -- \\
            --config examples/arithmetic_grpo.yaml run.steps=10 eval.at_start=false eval.at_end=false eval.every=0
    """
    p = _common.parser("step_memory", step_memory.__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="after --: relayrl train's arguments")
    a = p.parse_args(argv)
    args = [x for x in a.train_args if x != "--"]
    import relayrl.run.loop as loop
    from relayrl.cli import main as cli_main
    from relayrl.common.memory import heap_gb

    rows, perf = [], loop._perf

    def recording_perf(c, metrics, step_s):
        out = perf(c, metrics, step_s)
        rows.append({"step_s": round(step_s, 2), "rss_gb": out.get("mem/rss_gb"),
                     "peak_rss_gb": out.get("mem/peak_rss_gb"), "train_tokens": metrics.get("train/tokens"),
                     **heap_gb(), "live_tensors_gb": live_tensor_gb()})
        print("step_memory: " + json.dumps(rows[-1]), flush=True)
        return out

    loop._perf = recording_perf
    with tempfile.TemporaryDirectory(prefix="bench_step_memory_") as tmp:
        rc = cli_main(["train", *args, f"run.output_dir={tmp}", "run.save_final=false"])
    _common.write_json(a.out, _common.result_header("step_memory") | {
        "train_args": args, "env": {k: os.environ[k] for k in RECORDED_ENV if k in os.environ}, "exit_code": rc,
        "steps": rows})
    sys.exit(rc)


# ---- train_memory_trace ----------------------------------------------------------------------------------------
def trace_args(argv: list[str]) -> argparse.Namespace:
    p = _common.parser("train_memory_trace", train_memory_trace.__doc__)
    p.add_argument("--config", default="examples/arithmetic_grpo.yaml")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="alternating runs of each side")
    p.add_argument("--out", default="bench/results/train_memory_trace.json")
    p.add_argument("--side", choices=TRACE_SIDES, help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _status_gb(key: str) -> float:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key))
    return int(line.split()[1]) * 1024 / 1e9


class Trace:
    """Rows of (phase, RSS now, peak since the previous row)."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def mark(self, phase: str) -> None:
        self.rows.append({"phase": phase, "rss_gb": round(_status_gb("VmRSS"), 3),
                          "peak_since_last_gb": round(_status_gb("VmHWM"), 3)})
        Path("/proc/self/clear_refs").write_text("5")  # restart the high-water mark from the current RSS


def run_side(a) -> dict:
    import relayrl.run.loop  # noqa: F401 - everything the CLI imports
    import relayrl.trainer.engine as engine_module
    from relayrl.common.memory import trim_memory, tune_allocator
    from relayrl.config.schema import load_run_config
    from relayrl.run.build import build

    tune_allocator()
    if a.side == "no_trim":
        engine_module.trim_memory = lambda: None
    trace = Trace()
    fit_s = []
    with tempfile.TemporaryDirectory(prefix="bench_trace_") as tmp:
        cfg = load_run_config(a.config, [f"run.output_dir={tmp}", "run.tensorboard=false", "eval.at_start=false",
                                         "eval.at_end=false", f"run.steps={a.steps}", "run.print_samples=0"])
        c = build(cfg)
        engine = c.train_ctl.engine
        plain_micro = engine._micro_step

        def micro_step(mb, *rest):
            out = plain_micro(mb, *rest)
            trace.mark(f"micro-batch {mb.num_tokens} tokens")
            return out

        engine._micro_step = micro_step
        trace.mark("built")
        try:
            for step in range(1, a.steps + 1):
                batch, _ = c.rollouts.next_batch(c.train_ctl.version)
                trace.mark(f"step {step} rollout")
                c.rollouts.release_memory()
                t0 = time.perf_counter()
                c.train_ctl.fit(batch)
                fit_s.append(time.perf_counter() - t0)
                trace.mark(f"step {step} fit end")
                c.rollouts.load_weights(c.train_ctl.weights())
                trim_memory()
                trace.mark(f"step {step} weight sync")
        finally:
            c.close()
    train_rows = [r for r in trace.rows if r["phase"].startswith("micro-batch")]
    return {"side": a.side, "fit_s": [round(t, 2) for t in fit_s],
            "train_peak_gb": max(r["peak_since_last_gb"] for r in train_rows), "trace": trace.rows}


def trace_child(side: str, a) -> dict:
    return _common.run_child(str(MEMORY), ["train_memory_trace", "--side", side, "--config", a.config, "--steps",
                                           str(a.steps)], f"side {side}")


def train_memory_trace(argv: list[str]) -> None:
    """Resident memory through the README job's training steps, micro-batch by micro-batch, with and without the
    trainer's heap trims: what the trims buy and what they cost.

    Each side is a child process that builds the run from examples/arithmetic_grpo.yaml and steps it as
    relayrl.run.loop.train_steps does (rollout, release the engine's memory, fit, weight sync). Around every
    phase it reads VmRSS and the high-water mark since the previous mark (VmHWM, reset by writing 5 to
    /proc/self/clear_refs), so each row says how high memory went inside that phase. The "no_trim" side replaces
    relayrl.trainer.engine.trim_memory (called after each micro-batch's forward and backward) with a no-op; every
    other part is the shipped code. Sides alternate round by round; same data, seeds and batches on both.

        .venv/bin/python bench/memory.py train_memory_trace                 # 3 steps, 2 rounds of both sides
        .venv/bin/python bench/memory.py train_memory_trace --rounds 1 --steps 2
    """
    a = trace_args(argv)
    if a.side:
        _common.write_json(a.result_file, run_side(a))
        return
    load = _common.load_before_run()
    runs = [trace_child(side, a) for _ in range(a.rounds) for side in TRACE_SIDES]
    summary = {}
    for side in TRACE_SIDES:
        mine = [r for r in runs if r["side"] == side]
        summary[side] = {"train_peak_gb": [r["train_peak_gb"] for r in mine],
                         "fit_s_total": [round(sum(r["fit_s"]), 2) for r in mine]}
    ratio = statistics.median(summary["trim"]["fit_s_total"]) / statistics.median(summary["no_trim"]["fit_s_total"])
    result = _common.result_header("train_memory_trace") | {
        "load_before": load, "config": a.config, "steps": a.steps, "rounds": a.rounds, "summary": summary,
        "ratios": {"trim_vs_no_trim_fit_time": round(ratio, 3),
                   "trim_vs_no_trim_train_peak": round(statistics.median(summary["trim"]["train_peak_gb"])
                                                       / statistics.median(summary["no_trim"]["train_peak_gb"]), 3)},
        "runs": runs}
    _common.write_json(a.out, result)
    print(json.dumps({"summary": summary, "ratios": result["ratios"]}, indent=1))


# ---- backward_peak ---------------------------------------------------------------------------------------------
def _instrument(train_ctl, marks: Trace) -> None:
    """Hooks at the part boundaries; the micro-step itself is the trainer's (called through, not copied)."""
    import relayrl.trainer.engine as te

    plain_head = te.head_logprobs

    def head(model, hidden, *args, **kwargs):
        if hidden.requires_grad:
            hidden.register_hook(lambda g: marks.mark("lm_head_backward"))
        return plain_head(model, hidden, *args, **kwargs)

    def embedding_out(module, inputs, out):
        if out.requires_grad:
            out.register_hook(lambda g: marks.mark("layers_backward"))

    te.head_logprobs = head
    train_ctl.engine.model.get_input_embeddings().register_forward_hook(embedding_out)
    plain_micro = train_ctl.engine._micro_step

    def micro(mb, loss_fn, *rest):
        marks.mark("before_micro_batch")

        def loss_marked(mb, logp, entropy):  # the forward ends where the loss is taken
            out = loss_fn(mb, logp, entropy)
            marks.mark("forward")
            return out

        stats = plain_micro(mb, loss_marked, *rest)
        marks.mark("embedding_backward")
        return stats

    train_ctl.engine._micro_step = micro


def peak_step(train_ctl, marks: Trace, shape: dict, vocab: int, step: int, rng: random.Random) -> dict:
    """One step on random answers of the full length (no rollout needed to train), marked part by part."""
    import _scaling_child

    n_new, group = shape["new_tokens"], shape["group"]
    prompts = [[rng.randrange(3, vocab) for _ in range(shape["prompt_len"])] for _ in range(shape["prompts"])]
    outs = [types.SimpleNamespace(output_ids=[rng.randrange(3, vocab) for _ in range(n_new)],
                                  logprobs=[-1.0] * n_new, versions=[0] * n_new, finish_reason="length")
            for _ in range(shape["prompts"] * group)]
    marks.rows.clear()
    marks.mark("start")
    train_ctl.fit(_scaling_child._samples(outs, prompts, group, step, rng))
    marks.mark("optimizer_and_rest")
    top = max(marks.rows[1:], key=lambda r: r["peak_since_last_gb"])
    print(f"step {step}: peak {top['peak_since_last_gb']:.3f} GB in {top['phase']}", file=sys.stderr)
    return {"step": step, "parts": marks.rows[1:]}


def backward_peak(argv: list[str]) -> None:
    """Where a training step peaks: the resident high-water mark of each part of each micro-batch, at a model shape
    of bench/scaling.py (random weights), with the trainer's real micro-step.

    The high-water mark (VmHWM) is reset through /proc/self/clear_refs at each boundary, so each row says how high
    resident memory went inside that part: the forward, the LM head's backward (until the gradient of its hidden
    states exists), the layers' backward (until the input embedding's output gradient exists), the embedding's
    backward (to the end of loss.backward), then the optimizer step. Run it with MALLOC_MMAP_THRESHOLD_=1048576
    so that freed blocks leave RSS at once (otherwise glibc's retention blurs the parts). Found that a tied LM
    head's weight gradient waited in autograd's buffer through the layers' backward (docs/benchmarks.md).

        MALLOC_MMAP_THRESHOLD_=1048576 .venv/bin/python bench/memory.py backward_peak --size smollm2-135m
    """
    import _scaling_child
    import scaling

    p = _common.parser("backward_peak", backward_peak.__doc__)
    p.add_argument("--size", default="smollm2-135m", choices=sorted(scaling.SIZES | scaling.QUICK_SIZES))
    p.add_argument("--steps", type=int, default=2, help="the first step allocates the optimizer's state")
    p.add_argument("--out", default="bench/results/backward_peak.json")
    a = p.parse_args(argv)
    hf_config = (scaling.SIZES | scaling.QUICK_SIZES)[a.size][0]  # tiny-a: a seconds-long smoke run
    shape = {"prompts": 8, "group": 8, "prompt_len": 64, "new_tokens": 128}  # bench/scaling.py's step
    spec = {"hf_config": hf_config, "shape": shape, "overrides": ["model.gradient_checkpointing=true"]}
    marks, rng, vocab, steps = Trace(), random.Random(0), hf_config["vocab_size"], []
    with tempfile.TemporaryDirectory(prefix="bench_backward_peak_") as tmp:
        _cfg, train_ctl, rollout_ctl, engine = _scaling_child._build(spec, tmp)
        rollout_ctl.release_memory(weights=True)  # as during training in the colocated loop
        _instrument(train_ctl, marks)
        for step in range(1, a.steps + 1):
            steps.append(peak_step(train_ctl, marks, shape, vocab, step, rng))
        engine.close()
    result = {**_common.result_header("backward_peak"), "size": a.size, "shape": shape,
              "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"), "steps": steps}
    _common.write_json(a.out, result)
    print(f"wrote {a.out}", file=sys.stderr)
