"""bench/backward_peak.py on a tiny shape: every part of every micro-batch is marked, in order, and recorded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PARTS = ["forward", "lm_head_backward", "layers_backward", "embedding_backward"]


def test_each_micro_batch_is_marked_part_by_part(tmp_path):
    out = tmp_path / "peak.json"
    proc = subprocess.run([sys.executable, "bench/backward_peak.py", "--size", "tiny-a", "--steps", "2", "--out",
                           str(out)], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "1048576", "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["size"] == "tiny-a" and r["malloc_mmap_threshold"] == "1048576" and "torch_cpu_capability" in r["machine"]
    assert [s["step"] for s in r["steps"]] == [1, 2]
    for step in r["steps"]:
        names = [p["phase"] for p in step["parts"]]
        assert names[-1] == "optimizer_and_rest" and len(names) % 5 == 1  # 5 marks a micro-batch, then the step
        for k in range(0, len(names) - 1, 5):
            assert names[k: k + 5] == ["before_micro_batch", *PARTS]
        assert all(0 < p["rss_gb"] <= p["peak_since_last_gb"] + 0.05 for p in step["parts"])
