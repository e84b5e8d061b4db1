"""`bench/train.py fit_profile --quick`: a real fit of the tiny model profiled, its self time grouped, its matmul FLOPs
counted and set against this machine's matmul rate."""

from __future__ import annotations

from bench_for_tests import run_bench


def test_a_profiled_fit_is_grouped_and_its_matmuls_counted(tmp_path):
    r = run_bench("train.py", "fit_profile", "--quick", out=tmp_path / "profile.json")
    assert "torch_cpu_capability" in r["machine"] and r["settings"]["trained_tokens"] > 0
    assert r["settings"]["autocast_bf16"] is False and r["fit_s"] > 0 and r["profiled_fit_s"] > 0
    assert {"matmul", "elementwise", "other"} <= set(r["self_s"])
    assert abs(sum(r["self_s"].values()) - r["self_s_total"]) < 0.05
    assert r["matmul_gflop"] > 0 and r["matmul_gflops_in_fit"] > 0 and r["matmul_gflops_alone"] > 0
    assert any(op["op"] == "aten::mm" and op["calls"] > 0 for op in r["top_ops"])
