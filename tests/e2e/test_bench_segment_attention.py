"""`bench/kernels.py segment_attention --quick`: the shared-prompt attention kernel's forward and backward timed beside
another build of its source (here the same file: both builds must run and be reported)."""

from __future__ import annotations

import pytest
from bench_for_tests import run_bench

from relayrl.models import segments


@pytest.mark.skipif(segments.load_kernel() is None, reason="no C compiler: the kernel did not build")
def test_the_kernel_and_a_baseline_build_are_timed_on_one_and_two_row_micro_batches(tmp_path):
    r = run_bench("kernels.py", "segment_attention", "--quick", "--baseline-source", str(segments._SOURCE),
                  out=tmp_path / "r.json")
    assert [c["rows"] for c in r["cases"]] == [1, 2]
    for c in r["cases"]:
        assert c["visible_pairs_per_layer"] > 0 and c["width"] > 0
        for name in ("kernel", "baseline"):
            assert c[f"{name}_fwd_ms"] > 0 and c[f"{name}_bwd_ms"] > 0 and c[f"{name}_bwd_gflops"] > 0
        assert c["fwd_speedup"] > 0 and c["bwd_speedup"] > 0
    assert r["machine"]["torch_cpu_capability"]
