"""`bench/engine.py prefill --quick`: both prefill settings run every workload on the tiny model (a subprocess), and the
batched side prefills fewer tokens (the prompts' shared chat-template start once)."""

from __future__ import annotations

from bench_for_tests import run_bench


def test_prefill_bench_quick(tmp_path):
    r = run_bench("engine.py", "prefill", "--quick", out=tmp_path / "prefill.json")
    assert r["machine"]["torch_cpu_capability"] and r["sides"] == [0, 2048]
    for workload, s in r["summary"].items():
        one, batched = s["prefill_tokens"]["0"], s["prefill_tokens"]["2048"]
        assert batched < one, (workload, s)  # the chat template's start is shared
        assert all(v > 0 for v in s["median_wall_s"].values()) and s["speedup"] > 0
