"""bench/grpo_step_vs_trl.py: several seeds in one invocation, each a comparison of its own, and their median."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from bench_for_tests import REPO, run_bench

sys.path.insert(0, str(REPO / "bench"))  # the bench scripts import their helpers (_common) as top-level modules

import grpo_step_vs_trl as bench  # noqa: E402


def test_ratios_over_seeds_are_listed_seed_by_seed_with_their_median():
    per_seed = [{"relayrl_vs_trl_samples_per_s": 2.0, "relayrl_vs_trl_bf16_samples_per_s": None,
                 "trl_reference_side": "trl"},
                {"relayrl_vs_trl_samples_per_s": 6.0, "relayrl_vs_trl_bf16_samples_per_s": None,
                 "trl_reference_side": "trl"},
                {"relayrl_vs_trl_samples_per_s": 5.0, "relayrl_vs_trl_bf16_samples_per_s": None,
                 "trl_reference_side": "trl_bf16"}]
    out = bench.over_seeds(per_seed)
    assert out == {"relayrl_vs_trl_samples_per_s_by_seed": [2.0, 6.0, 5.0],
                   "relayrl_vs_trl_samples_per_s_median_over_seeds": 5.0}  # a side never run has no median


def test_quick_run_with_two_seeds_measures_each_on_its_own_prompts(tmp_path: Path):
    res = run_bench("grpo_step_vs_trl.py", "--quick", "--sides", "relayrl", "--seeds", "0,1", out=tmp_path / "r.json")
    assert res["workload"]["seeds"] == [0, 1]
    assert set(res["by_seed"]) == {"0", "1"}
    for b in res["by_seed"].values():
        assert len(b["metrics"]["relayrl"]["step_s_all"]) == 1  # --quick: 1 measured step per seed
    assert len(res["metrics"]["relayrl"]["step_s_all"]) == 2  # pooled: every seed's measured steps
    shas = res["checks"]["prompts_sha_per_step"]
    assert shas["0"]["relayrl"] != shas["1"]["relayrl"]  # each seed draws its own prompts
    assert res["checks"]["same_prompts_every_step"]


def test_seeds_must_be_integers():
    with pytest.raises(SystemExit):
        bench.parse_args(["--seeds", "0,x"])
