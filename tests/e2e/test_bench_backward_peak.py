"""`bench/memory.py backward_peak` on a tiny shape: every part of every micro-batch is marked, in order, and
recorded."""

from __future__ import annotations

from bench_for_tests import run_bench

PARTS = ["forward", "lm_head_backward", "layers_backward", "embedding_backward"]


def test_each_micro_batch_is_marked_part_by_part(tmp_path):
    r = run_bench("memory.py", "backward_peak", "--size", "tiny-a", "--steps", "2", out=tmp_path / "peak.json",
                  env={"MALLOC_MMAP_THRESHOLD_": "1048576"})
    assert r["size"] == "tiny-a" and r["malloc_mmap_threshold"] == "1048576" and "torch_cpu_capability" in r["machine"]
    assert [s["step"] for s in r["steps"]] == [1, 2]
    for step in r["steps"]:
        names = [p["phase"] for p in step["parts"]]
        assert names[-1] == "optimizer_and_rest" and len(names) % 5 == 1  # 5 marks a micro-batch, then the step
        for k in range(0, len(names) - 1, 5):
            assert names[k: k + 5] == ["before_micro_batch", *PARTS]
        assert all(0 < p["rss_gb"] <= p["peak_since_last_gb"] + 0.05 for p in step["parts"])
