"""`bench/kernels.py train_kernels --quick`: the norm/SwiGLU kernels and PyTorch's ops timed side by side, the bytes a
layer saves for backward with each (the kernels' must be fewer), and the LM head's blocks before and now."""

from __future__ import annotations

import pytest
from bench_for_tests import run_bench

from relayrl.models import fused


@pytest.mark.skipif(fused.load_kernel() is None, reason="no C compiler: the kernel did not build")
def test_both_variants_are_timed_and_the_kernels_save_less_for_backward(tmp_path):
    r = run_bench("kernels.py", "train_kernels", "--quick", out=tmp_path / "r.json")
    for op in ("rms_norm", "swiglu"):
        assert r["layer_ops"][op]["pytorch_ms"] > 0 and r["layer_ops"][op]["kernel_ms"] > 0
    for arch in ("llama", "qwen2"):
        saved = r["saved_for_backward_per_layer"][arch]
        assert 0 < saved["kernel_mb"] < saved["pytorch_mb"]
    (head,) = r["lm_head"]
    assert head["chunk_budget_ms"] > 0 and head["cache_sized_ms"] > 0 and head["cols_now"] <= head["cols_before"]
    assert r["machine"]["torch_cpu_capability"]
