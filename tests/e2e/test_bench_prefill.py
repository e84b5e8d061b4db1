"""bench/prefill.py --quick: both prefill settings run every workload on the tiny model (a subprocess), and the
batched side prefills fewer tokens (the prompts' shared chat-template start once)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_prefill_bench_quick(tmp_path):
    out = tmp_path / "prefill.json"
    proc = subprocess.run([sys.executable, "bench/prefill.py", "--quick", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["machine"]["torch_cpu_capability"] and r["sides"] == [0, 2048]
    for workload, s in r["summary"].items():
        one, batched = s["prefill_tokens"]["0"], s["prefill_tokens"]["2048"]
        assert batched < one, (workload, s)  # the chat template's start is shared
        assert all(v > 0 for v in s["median_wall_s"].values()) and s["speedup"] > 0
