#!/usr/bin/env python
"""The README's main job, timed as a user runs it: wall clock, peak RSS, pass@1 before and after.

Runs `relayrl train --config examples/arithmetic_grpo.yaml` (the README's first command after setup) as a
subprocess and reads its run folder. `--cpu avx2` runs it as on a CPU without AVX-512 or native bf16
(ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2: bf16 matmuls drop to ~1 GFLOP/s, so `engine.dtype: auto`
picks float32), which is how an AVX2-only laptop behaves on any x86 machine.

`peak_rss_gb` is the trainer process's own high-water mark: getrusage(RUSAGE_CHILDREN).ru_maxrss is the largest
single descendant's peak, never a sum, and the trainer is the largest. The judge workers (the trainer's own
child processes, about 0.15 GB together) are sampled every 50 ms and reported apart (`judge_workers_peak_rss_gb`);
`tree_peak_rss_gb` is the sampled peak of trainer + workers together.

    .venv/bin/python bench/readme_job.py                  # this CPU as it is
    .venv/bin/python bench/readme_job.py --cpu avx2       # as on an AVX2-only CPU
    .venv/bin/python bench/readme_job.py run.steps=3      # overrides for a shorter check (not recorded)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

import _common


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", choices=["native", "avx2"], default="native")
    p.add_argument("--config", default="examples/arithmetic_grpo.yaml")
    p.add_argument("--out", help="result file (default bench/results/readme_job_<cpu>.json; overrides: not written)")
    p.add_argument("overrides", nargs="*")
    return p.parse_args(argv)


def run(a, tmp: str) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(_common.AVX2_ENV if a.cpu == "avx2" else {})}
    if a.cpu == "avx2":  # the dtype measurement is cached per switch setting: this measures AVX2 behaviour
        code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
        cap = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout.strip()
        assert cap == "AVX2", cap
    r = _common.train_run(a.config, a.overrides, tmp, env)
    output, wall, peaks, run_dir = r["output"], r["wall_s"], r["peaks"], r["run_dir"]
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in rows if "eval/pass@1" in r]
    steps = [r for r in rows if "train/loss" in r]
    precision = next((line for line in output.splitlines() if line.startswith("precision:")), "")
    return {"wall_s": round(wall, 1), "wall_min": round(wall / 60, 2), "peak_rss_gb": round(peak / 1e9, 3),
            "judge_workers_peak_rss_gb": round(peaks["workers"] / 1e9, 3),
            "tree_peak_rss_gb": round(peaks["tree"] / 1e9, 3),
            "steps": len(steps), "precision": precision,
            "step_s_median": sorted(r["time/step_s"] for r in steps)[len(steps) // 2],
            "rollout_s_median": sorted(r["time/rollout_s"] for r in steps)[len(steps) // 2],
            "train_s_median": sorted(r["time/train_s"] for r in steps)[len(steps) // 2],
            "eval": [{"step": r["step"], "pass@1": r["eval/pass@1"], "seconds": round(r.get("time/eval_s", 0.0), 1)}
                     for r in evals],
            "len_mean_by_step": [round(r.get("rollout/response_len_mean", 0.0), 1) for r in steps],
            "truncated_frac_by_step": [round(r.get("rollout/truncated_frac", 0.0), 3) for r in steps],
            "train_s_by_step": [round(r["time/train_s"], 2) for r in steps],
            "rollout_s_by_step": [round(r["time/rollout_s"], 2) for r in steps],
            # samples whose advantages were all 0, left out of the forward/backward (TrainController._contributing)
            "samples_skipped_zero_adv_by_step": [r.get("train/samples_skipped_zero_adv") for r in steps],
            # the trainer's high-water mark after each step: where in the run the peak came
            "peak_rss_gb_by_step": [round(r["mem/peak_rss_gb"], 3) for r in steps if "mem/peak_rss_gb" in r]}


def main() -> None:
    a = parse_args()
    load = _common.load_before_run()
    allocator = ("RELAYRL_MALLOC_ARENAS", "MALLOC_ARENA_MAX", "RELAYRL_MMAP_THRESHOLD")  # tune_allocator reads them
    env_note = (_common.AVX2_ENV if a.cpu == "avx2" else {}) | {k: os.environ[k] for k in allocator if k in os.environ}
    os.environ.update(env_note)  # machine_info measures what this setting does
    res = {**_common.result_header(f"readme_job_{a.cpu}"), "load_before": load, "cpu_setting": a.cpu,
           "env": env_note, "config": a.config, "overrides": a.overrides}
    with tempfile.TemporaryDirectory(prefix="bench_readme_") as tmp:
        res |= run(a, tmp)
    print(json.dumps(res, indent=2))
    out = a.out or (None if a.overrides else f"bench/results/readme_job_{a.cpu}.json")
    if out:
        _common.write_json(out, res)


if __name__ == "__main__":
    main()
