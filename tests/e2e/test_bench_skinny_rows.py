"""`bench/kernels.py skinny_rows --quick`: PyTorch's linear, the few-row kernel and a second kernel source timed at each
row count; a row count the second source refuses is left out for it, not failed."""

from __future__ import annotations

import pytest
from bench_for_tests import REPO, run_bench

from relayrl.engine import skinny


@pytest.mark.skipif(skinny.load_kernel() is None, reason="no C compiler: the kernel did not build")
def test_every_variant_is_timed_and_a_refused_row_count_is_left_out(tmp_path):
    # a version of the kernel that takes at most 8 rows: its refusal at 64 rows must not fail the bench
    source = (REPO / "relayrl/engine/kernels/skinny_linear.c").read_text()
    limited = tmp_path / "skinny_linear_limited.c"
    limited.write_text(source.replace("#define MAX_ROWS 64", "#define MAX_ROWS 8"))
    r = run_bench("kernels.py", "skinny_rows", "--quick", "--also", str(limited), out=tmp_path / "r.json")
    rows = {row["rows"]: row for row in r["rows"]}
    assert sorted(rows) == [1, 8, 64] and r["workload"]["also"] == str(limited)
    for m in (1, 8):
        assert rows[m]["pytorch_ms"] > 0 and rows[m]["kernel_ms"] > 0 and rows[m]["kernel_also_ms"] > 0
        assert rows[m]["kernel_vs_also"] > 0 and rows[m]["kernel_vs_pytorch"] > 0
    assert "kernel_also_ms" not in rows[64] and rows[64]["kernel_ms"] > 0


@pytest.mark.skipif(skinny.load_kernel() is None, reason="no C compiler: the kernel did not build")
def test_a_source_from_before_the_multi_call_is_still_compared(tmp_path):
    # sources before 0a9ae4f export only relayrl_skinny_linear_f32: the bench calls nothing else of them
    source = (REPO / "relayrl/engine/kernels/skinny_linear.c").read_text()
    older = tmp_path / "skinny_linear_single.c"
    older.write_text(source.replace("int relayrl_skinny_multi_f32(int64_t m", "static int multi_impl(int64_t m")
                     .replace("relayrl_skinny_multi_f32(", "multi_impl("))
    r = run_bench("kernels.py", "skinny_rows", "--quick", "--also", str(older), out=tmp_path / "r.json")
    assert all(row["kernel_also_ms"] > 0 for row in r["rows"])
