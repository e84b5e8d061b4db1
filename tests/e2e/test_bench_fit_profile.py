"""bench/fit_profile.py --quick: a real fit of the tiny model profiled, its self time grouped, its matmul FLOPs
counted and set against this machine's matmul rate."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_profiled_fit_is_grouped_and_its_matmuls_counted(tmp_path):
    out = tmp_path / "profile.json"
    proc = subprocess.run([sys.executable, "bench/fit_profile.py", "--quick", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert "torch_cpu_capability" in r["machine"] and r["settings"]["trained_tokens"] > 0
    assert r["settings"]["autocast_bf16"] is False and r["fit_s"] > 0 and r["profiled_fit_s"] > 0
    assert {"matmul", "elementwise", "other"} <= set(r["self_s"])
    assert abs(sum(r["self_s"].values()) - r["self_s_total"]) < 0.05
    assert r["matmul_gflop"] > 0 and r["matmul_gflops_in_fit"] > 0 and r["matmul_gflops_alone"] > 0
    assert any(op["op"] == "aten::mm" and op["calls"] > 0 for op in r["top_ops"])
