"""bench/time_to_accuracy.py: the --quick smoke run end to end (three real subprocess sides on the tiny model, the
TRL eval callback, the JSON and the plot), the stop at the target, and the ratio bounds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "time_to_accuracy.py"
sys.path.insert(0, str(REPO / "bench"))  # the bench scripts import their helpers (_common) as top-level modules

import time_to_accuracy as tta  # noqa: E402

POINT_KEYS = {"step", "samples", "wall_s_excl_eval", "pass@1", "stderr", "eval_s"}


def run_quick(tmp_path: Path, *args: str, watch_first_side: bool = False) -> dict:
    """The --quick bench as a subprocess; with `watch_first_side`, also the result file as it stands between the
    first side and the second (it is written after each side, temp file + rename: a run killed then keeps it)."""
    pytest.importorskip("trl")
    results = tmp_path / "results"
    results.mkdir()
    out, png, log = results / "tta.json", results / "tta.png", tmp_path / "output.txt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.open("w") as f:
        proc = subprocess.Popen([sys.executable, str(SCRIPT), "--quick", "--out", str(out), "--plot", str(png), *args],
                                cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
    if watch_first_side:
        deadline = time.monotonic() + 240
        while not out.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        first = json.loads(out.read_text())
        assert proc.poll() is None, "the run ended before the first side's file could be read"
        assert first["complete"] is False and first["sides_done"] == ["sync"] and set(first["metrics"]) == {"sync"}
        assert [p["step"] for p in first["metrics"]["sync"]["curve"]] == [0, 1, 2]
        assert sorted(p.name for p in results.iterdir()) == ["tta.json"]  # no temp file left, no plot yet
    proc.wait(timeout=300)
    assert proc.returncode == 0, log.read_text()[-6000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return json.loads(out.read_text())


@pytest.mark.slow
def test_quick_run_has_curves_for_all_three_sides_and_keeps_each_finished_side(tmp_path):
    recorded = REPO / "bench" / "results" / "time_to_accuracy.json"
    before = recorded.stat().st_mtime_ns if recorded.exists() else None
    r = run_quick(tmp_path, watch_first_side=True)
    assert (recorded.stat().st_mtime_ns if recorded.exists() else None) == before  # the real result is untouched
    assert set(r["metrics"]) == {"sync", "async", "trl"}
    for side, m in r["metrics"].items():
        curve = m["curve"]
        assert [p["step"] for p in curve] == [0, 1, 2], side  # eval at start, then every step (--quick: 2 steps)
        assert all(set(p) == POINT_KEYS for p in curve)
        assert [p["samples"] for p in curve] == [0, 4, 8]  # 2 prompts x 2 samples per step
        walls = [p["wall_s_excl_eval"] for p in curve]
        assert walls[0] == 0 and walls[1] > 0 and walls == sorted(walls)
        assert all(0 <= p["pass@1"] <= 1 and p["stderr"] >= 0 for p in curve)
        assert m["stopped_by"] == "max_steps" and m["reached_target"] is False  # the random model stays far below
        assert m["time_to_target_s"] is None and m["samples_to_target"] is None
        assert m["steps_trained"] == 2 and m["samples_trained"] == 8
    assert r["metrics"]["async"]["settings"]["decoupled"] is True
    for side in ("sync", "async"):  # where each step's time went, summing to the curve's wall clock
        steps = r["metrics"][side]["steps"]
        assert [s["step"] for s in steps] == [1, 2] and all(s["train_s"] > 0 and s["len_mean"] > 0 for s in steps)
        assert sum(s["step_s"] for s in steps) == pytest.approx(r["metrics"][side]["curve"][-1]["wall_s_excl_eval"],
                                                                 abs=1e-3)
    assert r["metrics"]["async"]["settings"]["scheduler"] == "async"
    assert r["metrics"]["trl"]["optimizer_steps"] == 2
    for name in ("async_vs_sync", "relayrl_vs_trl"):
        for what in ("time", "samples"):
            assert r["ratios"][f"{name}_{what}_to_acc"] is None
            assert r["ratios"][f"{name}_{what}_to_acc_kind"] == "undetermined"
    assert r["workload"]["eval_size"] == 4 and r["workload"]["temperature"] == 1.0
    assert r["machine"]["cores"] and "time_to_accuracy.py --quick" in r["command"]
    assert set(r["checks"]["pass_at_step0"]) == {"sync", "async", "trl"}
    assert r["complete"] is True and r["sides_done"] == ["sync", "async", "trl"]  # written after each side too


@pytest.mark.slow
def test_quick_run_stops_each_side_at_the_target(tmp_path):
    r = run_quick(tmp_path, "--target", "0", "--max-steps", "500", "--sides", "sync,trl")
    for m in r["metrics"].values():
        assert m["stopped_by"] == "target" and m["reached_target"] is True
        assert len(m["curve"]) == 1 and m["steps_trained"] == 0 and m["time_to_target_s"] == 0
    assert r["metrics"]["sync"]["interrupted"] is True  # 500 steps asked: the run was stopped, not finished
    close = r["metrics"]["sync"]["close"]  # SIGTERM to exit, timed: the run shut down by itself
    assert close["killed"] is False and 0 < close["seconds"] < 60
    assert r["metrics"]["trl"]["optimizer_steps"] == 0
    assert r["ratios"]["relayrl_vs_trl_time_to_acc_kind"] == "undetermined"  # both at the target before training


def test_a_side_stuck_in_shutdown_dumps_every_process_stack_then_is_killed(tmp_path):
    """The stuck process and its child both ignore SIGTERM; both stacks land in the log, neither survives."""
    code = ("import signal, subprocess, sys, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "child = 'import signal, time\\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
            "def child_waits():\\n    time.sleep(60)\\nprint(\\'child ready\\', flush=True)\\nchild_waits()'\n"
            "subprocess.Popen([sys.executable, '-c', child])\n"
            "def parent_waits():\n    time.sleep(60)\n"
            "print('parent ready', flush=True)\nparent_waits()\n")
    log = tmp_path / "side.log"
    with log.open("w") as f:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONFAULTHANDLER": "1"})
        deadline = time.monotonic() + 30  # both processes have their handlers before the signals come
        while not {"parent ready", "child ready"} <= set(log.read_text().split("\n")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert {"parent ready", "child ready"} <= set(log.read_text().split("\n")), log.read_text()
        tree = tta.descendants(proc.pid)
        close = tta.stop_side(proc, timeout=0.5, dump_s=1.0)
    assert close["killed"] is True and close["processes"] == 2 and len(tree) == 1
    text = log.read_text()
    assert "parent_waits" in text and "child_waits" in text, text
    time.sleep(0.2)
    try:  # gone, or a zombie waiting for the reaper of its killed parent
        state = Path(f"/proc/{tree[0]}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        state = "gone"
    assert state in ("gone", "Z"), state


def side(time_s: float | None, total_s: float, samples: int | None = None, trained: int = 64) -> dict:
    return {"time_to_target_s": time_s, "wall_s_excl_eval_total": total_s, "samples_to_target": samples,
            "samples_trained": trained}


def test_ratio_exact_and_bounds():
    args = ("time_to_target_s", "wall_s_excl_eval_total")
    assert tta.ratio(side(100, 100), side(50, 60), *args) == {"value": 2.0, "kind": "exact", "bound": None}
    lower = tta.ratio(side(None, 300), side(50, 60), *args)  # num missed the target: its time is > 300
    assert lower["kind"] == "lower_bound" and lower["bound"] == ">= 6" and lower["value"] is None
    upper = tta.ratio(side(100, 100), side(None, 400), *args)  # den missed it: its time is > 400
    assert upper["kind"] == "upper_bound" and upper["bound"] == "<= 0.25"
    assert tta.ratio(side(None, 1), side(None, 1), *args)["kind"] == "undetermined"
    assert tta.ratio(side(100, 100), None, *args)["kind"] == "not_run"


def test_ratios_name_sync_over_async_and_trl_over_sync():
    m = {"sync": side(120, 120, 640), "async": side(60, 60, 704), "trl": side(None, 600, None, 960)}
    r = tta.ratios(m)
    assert r["async_vs_sync_time_to_acc"] == 2.0 and r["async_vs_sync_time_to_acc_kind"] == "exact"
    assert r["async_vs_sync_samples_to_acc"] == 640 / 704
    assert r["relayrl_vs_trl_time_to_acc"] is None and r["relayrl_vs_trl_time_to_acc_bound"] == ">= 5"
    assert r["relayrl_vs_trl_samples_to_acc_bound"] == ">= 1.5"


def test_ratios_at_equal_steps_compare_the_steps_both_sides_reached():
    curve = lambda *walls: [{"step": 5 * i, "wall_s_excl_eval": w} for i, w in enumerate(walls)]
    m = {"sync": {**side(40, 40), "curve": curve(0, 25, 40)},  # crossed at step 10
         "async": {**side(27, 27), "curve": curve(0, 16, 22, 27)},  # crossed at step 15
         "trl": {**side(None, 600), "curve": curve(0, 100, 200, 300)}}
    r = tta.ratios(m)
    assert r["async_vs_sync_time_at_equal_steps"] == {"5": 25 / 16, "10": 40 / 22}
    assert r["relayrl_vs_trl_time_at_equal_steps"] == {"5": 4.0, "10": 5.0}
    assert tta.ratios({"sync": m["sync"]})["async_vs_sync_time_at_equal_steps"] == {}


def test_stop_rule_fires_at_target_then_budget():
    a = tta.parse_args(["--target", "0.5", "--budget-min", "1"])
    stop = tta.stop_rule(a)
    point = lambda p, wall: {"step": int(wall), "samples": 4 * int(wall), "pass@1": p, "wall_s_excl_eval": wall}
    assert stop([]) is None and stop([point(0.4, 59)]) is None
    assert stop([point(0.5, 10)]) == "target" and stop([point(0.4, 60)]) == "budget"
    settled = tta.settle({"curve": [point(0.1, 0), point(0.6, 5), point(0.7, 9)]}, stop)
    assert len(settled["curve"]) == 2 and settled["stopped_by"] == "target" and settled["steps_trained"] == 5
    assert tta.settle({"curve": [point(0.1, 0), point(0.2, 5)]}, stop)["stopped_by"] == "max_steps"


def test_the_trl_side_resolves_auto_checkpointing_as_relayrl_does(tiny_path, monkeypatch):
    """"auto" is relayrl's rule (on when the floor of 16 bytes per parameter is a fifth of the memory or more), so both
    sides of the bench train with the same memory setting; an explicit setting passes through."""
    import _tta_trl

    from relayrl.config.schema import Config
    from relayrl.models import load_model

    cfg = Config()
    cfg.model.path = str(tiny_path)
    for setting in (True, False):
        cfg.model.gradient_checkpointing = setting
        assert _tta_trl.trl_checkpointing(cfg) is setting
    cfg.model.gradient_checkpointing = "auto"
    assert _tta_trl.trl_checkpointing(cfg) is False  # the tiny model's floor is nothing next to this machine's RAM
    floor = 16 * sum(p.numel() for p in load_model(str(tiny_path)).parameters())
    monkeypatch.setattr(_tta_trl, "device_memory_bytes", lambda device: 2 * floor)
    assert _tta_trl.trl_checkpointing(cfg) is True
