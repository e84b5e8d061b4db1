"""scripts/gpu_check.sh and its helper `bench/train.py random_model`, on this machine (no GPU): the script must say that
CUDA is absent and succeed without running anything, and the helper must write a folder relayrl loads and runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bench_for_tests import run_bench

from relayrl.engine.base import SamplingParams
from relayrl.engine.local import LocalEngine

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_gpu_check_without_cuda_says_so_and_runs_nothing():
    proc = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHON": sys.executable, "MODEL": "/nonexistent"})
    assert proc.returncode == 0, proc.stderr
    assert "CUDA is not available" in proc.stdout and "no GPU tests or benches were run" in proc.stdout
    assert "== tests" not in proc.stdout


def test_random_model_has_the_shape_and_tokenizer_and_generates(tiny_path, tmp_path):
    out = tmp_path / "random"
    cmd = [sys.executable, "bench/train.py", "random_model", "--shape", "tiny-a", "--tokenizer", tiny_path,
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (64, 2, 2048)
    assert (out / "tokenizer.json").read_bytes() == (Path(tiny_path) / "tokenizer.json").read_bytes()
    assert (out / "RANDOM_WEIGHTS").is_file()  # what scripts/gpu_check.sh reads to skip its learning run
    eng = LocalEngine.from_pretrained(str(out), dtype="float32", max_batch_size=2)
    try:
        [res] = eng.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))
    finally:
        eng.close()
    assert len(res.output_ids) == 4
    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert again.returncode != 0 and "exists" in again.stderr  # never overwrites a folder


def test_engine_step_parts_and_decode_profile_run_on_the_cpu(tiny_path, tmp_path):
    """The two probes that found the GPU's host-bound decode, on the tiny model: their parts add up and the
    profiles name real ops."""
    r = run_bench("engine.py", "engine_step_parts", "--quick", "--profile", out=tmp_path / "parts.json")
    steps = r["decode_steps"]
    assert steps == r["workload"]["max_new_tokens"] - 1  # the first token of each sample comes from its prefill
    assert r["parts_s"]["forward_decode"] <= r["parts_s"]["decode_step"] <= r["worker_busy_s"] <= r["wall_s"]
    assert r["bare_decode_forward_ms"] > 0
    # the linears show as matmul ops, or (few rows, where relayrl.engine.skinny's kernel serves them) as its calls
    assert (any(op["op"] in ("aten::mm", "aten::addmm") for op in r["profile"]["self_cpu_time_total"])
            or any("skinny" in f["function"] for f in r["profile"]["python_tottime"]))
    assert r["profile"]["python_tottime"]
    cmd = [sys.executable, "bench/engine.py", "decode_profile", tiny_path, "cpu", "--batch", "4", "--context", "16"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "decode ms" in proc.stdout and "self_cpu_time_total" in proc.stdout
