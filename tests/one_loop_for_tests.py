"""A short fixed-seed run recorded step by step, for the one-loop test (tests/integration/test_one_loop.py): each
step's batch (token ids, rewards, groups) and every metric the run logs. The golden file it compares against was
recorded with the two loops that came before the shared body (sync and async), so a change in the sync numbers
or in either run's metric keys shows there.

Re-record (only when a change is meant to move the numbers): python tests/one_loop_for_tests.py
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

GOLDEN = Path(__file__).parent / "fixtures" / "one_loop_golden.json"

# keys whose values depend on the clock or the machine's memory: recorded as keys only (seconds end in _s)
TIMED = ("time/", "perf/", "mem/", "engine/busy_", "rollout/held_frac")


def timed(key: str) -> bool:
    return key.startswith(TIMED) or key.endswith("_s")


# the engine's and the trainer's log-probabilities of the same tokens differ by float rounding alone, and rounding
# differs between CPU kinds (AVX2 and AVX-512 kernels): compared within this absolute tolerance
ROUNDING = ("train/logprob_diff_engine_",)
ROUNDING_TOL = 1e-5


class Recording:
    """The run's rollout source, unchanged, with each batch it hands the loop written down."""

    def __init__(self, source: Any):
        self._source = source
        self.batches: list[list[dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._source, name)

    def next_batch(self, version: int):
        batch, metrics = self._source.next_batch(version)
        groups: dict[str, int] = {}
        self.batches.append([{"prompt": s.prompt_ids, "response": s.response_ids, "reward": s.reward,
                              "group": groups.setdefault(s.group_id, len(groups)), "index": s.index}
                             for s in batch])
        return batch, metrics


def overrides(model: str, data: str, out: str, **extra: Any) -> list[str]:
    """A tiny run (tests/conftest.py) with an eval set at start, every step and end, and a fixed seed."""
    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import tiny_run_args

    return tiny_run_args(model, data, out, **{
        "data.eval.source": data, "eval.size": 2, "eval.n": 1, "eval.at_start": True, "eval.at_end": True,
        "eval.every": 1, "run.steps": 3, "run.seed": 7, "sampling.max_new_tokens": 8, **extra})


def run(model: str, data: str, out: str, loop, **extra: Any) -> dict[str, Any]:
    """Build and run the tiny run through `loop`; its batches and metrics rows (step, keys, values)."""
    from relayrl.common.files import read_jsonl
    from relayrl.config.schema import load_run_config
    from relayrl.run.build import build

    c = build(load_run_config(None, overrides(model, data, out, **extra)))
    c.rollouts = rec = Recording(c.rollouts)
    try:
        loop(c)
    finally:
        c.close()
    rows = [{"step": r["step"], "keys": sorted(k for k in r if k != "step"),
             "values": {k: v for k, v in r.items() if k != "step" and not timed(k)}}
            for r in read_jsonl(c.run_dir / "metrics.jsonl")]
    return {"batches": rec.batches, "rows": rows}


def mismatches(got: dict[str, Any], want: dict[str, Any], rel: float = 1e-6) -> list[str]:
    """Where two recorded runs differ: batches token for token, metric keys exactly, values exact for integers
    and within `rel` for floats."""
    out = [f"step {i + 1}: batch differs" for i, (a, b) in enumerate(zip(got["batches"], want["batches"])) if a != b]
    if len(got["batches"]) != len(want["batches"]):
        out.append(f"{len(got['batches'])} batches, want {len(want['batches'])}")
    if (steps := [r["step"] for r in got["rows"]]) != (want_steps := [r["step"] for r in want["rows"]]):
        out.append(f"rows at steps {steps}, want {want_steps}")
    for a, b in zip(got["rows"], want["rows"]):
        if a["keys"] != b["keys"]:
            out.append(f"step {b['step']}: keys +{sorted(set(a['keys']) - set(b['keys']))} "
                       f"-{sorted(set(b['keys']) - set(a['keys']))}")
        for k, v in b.get("values", {}).items():
            x = a.get("values", {}).get(k)
            if not isinstance(x, float) or not isinstance(v, float):
                same = x == v
            elif k.startswith(ROUNDING):
                same = abs(x - v) <= ROUNDING_TOL
            else:
                same = math.isclose(x, v, rel_tol=rel, abs_tol=1e-12)
            if not same:
                out.append(f"step {b['step']}: {k} = {x!r}, want {v!r}")
    return out


def key_sets(recorded: dict[str, Any]) -> dict[str, list[str]]:
    """The metric keys of the training rows and of the eval rows: what an async run keeps fixed. Its numbers
    depend on timing, and so do some keys of a single row (engine/* only where the engines decoded in that
    step), so each set is the union over the run."""
    train = {k for r in recorded["rows"] if "train/loss" in r["keys"] for k in r["keys"]}
    evals = {k for r in recorded["rows"] if "train/loss" not in r["keys"] for k in r["keys"]}
    return {"train": sorted(train), "eval": sorted(evals)}


def record(loop_sync, loop_async) -> dict[str, Any]:
    """The golden file's content: the sync run in full, the async run's key sets."""
    from relayrl.models import tiny_model
    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import write_sums

    with tempfile.TemporaryDirectory() as tmp:
        data = write_sums(Path(tmp) / "sums.jsonl", 12)
        model = str(tiny_model("qwen2"))
        sync = run(model, data, tmp, loop_sync, **{"run.name": "sync"})
        asyn = run(model, data, tmp, loop_async, **{"run.name": "async", "scheduler.mode": "async",
                                                    "scheduler.max_staleness": 1})
    return {"sync": sync, "async_keys": key_sets(asyn)}


if __name__ == "__main__":
    from relayrl.run import loop

    GOLDEN.write_text(json.dumps(record(loop.train_steps, loop.train_steps), indent=None) + "\n")
    print(f"wrote {GOLDEN} ({GOLDEN.stat().st_size} bytes)")
