"""`bench/kernels.py engine_linear --quick`: both linear libraries measured at decode shapes, and a real engine
generating with each (subprocesses), on the tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this PyTorch has no oneDNN")
def test_both_libraries_are_measured_and_the_engine_runs_on_each():
    proc = subprocess.run([sys.executable, "bench/kernels.py", "engine_linear", "--quick"], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout[proc.stdout.index("{\n"):])
    assert {s: [run["linear"] for run in runs] for s, runs in r["runs"].items()} == {"default": ["default"],
                                                                                     "onednn": ["onednn"]}
    assert all(run["tokens"] == 2 * 2 * 8 and run["seconds"] > 0 for runs in r["runs"].values() for run in runs)
    assert set(r["shapes_gflops"]) >= {"lm_head", "gate/up_proj"} and r["onednn_vs_default_speedup"] > 0
    assert all(v["default_gflops"] > 0 and v["onednn_gflops"] > 0 for v in r["shapes_gflops"].values())
