"""Trajectory logs: per policy version, a readable text file and a JSONL line per trajectory.

Layout: RUN_DIR/trajectories/<version_start>/samples.txt and .../monitor.jsonl. Each record is written
with one O_APPEND write, so a crash can cut off at most the last record, never leave half of one in the
middle, and `read_jsonl` skips an unterminated last line. `relayrl show-trajectories RUN_DIR` prints
them back with colour: prompt, generated turns (green if the trajectory succeeded, red if not) and the
tokens the agent inserted (feedback, tool results).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from relayrl.common.files import append_jsonl, read_jsonl
from relayrl.sample import Sample

DIM, YELLOW, GREEN, RED = "\033[2m", "\033[33m", "\033[32m", "\033[31m"
CYAN, BOLD, RESET = "\033[36m", "\033[1m", "\033[0m"


def segments(sample: Sample, decode) -> list[dict[str, str]]:
    """The response split into generated turns ("gen") and agent-inserted context ("ctx"), as text. A generated
    turn that got a reward of its own (an environment's step, a reflection turn) carries it as "reward"."""
    out, pos = [], 0
    for turn in sample.turns:
        if turn.start > pos:
            out.append({"kind": "ctx", "text": decode(sample.response_ids[pos: turn.start])})
        gen = {"kind": "gen", "text": decode(sample.response_ids[turn.start: turn.end])}
        if turn.step_reward is not None:
            gen["reward"] = turn.step_reward
        out.append(gen)
        pos = turn.end
    if pos < len(sample.response_ids):
        out.append({"kind": "ctx", "text": decode(sample.response_ids[pos:])})
    return out


def record(sample: Sample, decode, step: int) -> dict[str, Any]:
    v0, v1 = sample.version_range()
    return {"step": step, "uid": sample.uid, "group_id": sample.group_id, "version_start": v0, "version_end": v1,
            "success": bool(sample.metrics.get("correct", (sample.reward or 0) > 0)), "reward": sample.reward,
            "prompt_len": len(sample.prompt_ids), "answer_len": len(sample.response_ids),
            "turns": len(sample.turns), "finish_reason": sample.finish_reason, "status": str(sample.status),
            "turn_versions": [[t.version_start, t.version_end] for t in sample.turns],
            "prompt": decode(sample.prompt_ids), "segments": segments(sample, decode),
            "answer": sample.data.get("answer"), "error": sample.error}


def render(rec: dict[str, Any], colour: bool = True) -> str:
    """A trajectory as readable text (ANSI colours optional)."""
    c = (lambda code, text: f"{code}{text}{RESET}") if colour else (lambda code, text: text)
    ok = rec["success"]
    head = (f"[{rec['uid']} group {rec['group_id']}] versions {rec['version_start']}..{rec['version_end']} "
            f"turns {rec['turns']} reward {rec['reward']} {'SUCCESS' if ok else 'FAIL'} (gold: {rec['answer']})")
    body = [c(BOLD, head), c(DIM + YELLOW, rec["prompt"])]
    for seg in rec["segments"]:
        body.append(c(GREEN if ok else RED, seg["text"]) if seg["kind"] == "gen" else c(CYAN, seg["text"]))
        if "reward" in seg:
            body.append(c(DIM, f" [turn reward {seg['reward']:g}]"))
    if rec.get("error"):
        body.append(c(RED, f"error: {rec['error']}"))
    return body[0] + "\n" + "".join(body[1:]) + "\n"


def sample_rows(samples: list[Sample], tokenizer, step: int, n: int) -> list[dict[str, Any]]:
    """`n` of a step's samples for the trackers (MetricsLogger.log_samples), spread over the batch: a batch is
    grouped by prompt, so its first n would often be one prompt's group. Texts decoded as the trajectories are."""
    if n <= 0 or not samples:
        return []
    decode = functools.partial(tokenizer.decode, skip_special_tokens=False)
    picked = samples[:: max(1, len(samples) // n)][:n]
    return [{"step": step, "prompt": decode(s.prompt_ids), "completion": decode(s.response_ids),
             "reward": None if s.reward is None else float(s.reward)} for s in picked]


class TrajectoryLogger:
    def __init__(self, run_dir: str | Path, tokenizer):
        self.root = Path(run_dir) / "trajectories"
        self.decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)

    def log(self, samples: list[Sample], step: int) -> None:
        for s in samples:
            rec = record(s, self.decode, step)
            folder = self.root / str(rec["version_start"])
            append_jsonl(folder / "monitor.jsonl", rec)
            _append_text(folder / "samples.txt", render(rec, colour=False) + "\n")


def _append_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def load_trajectories(run_dir: str | Path, version: int | None = None) -> list[dict[str, Any]]:
    root = Path(run_dir) / "trajectories"
    if not root.is_dir():
        raise FileNotFoundError(f"{root} does not exist: was the run started with trajectory logging on?")
    folders = [root / str(version)] if version is not None else sorted(
        (p for p in root.iterdir() if p.is_dir()), key=lambda p: int(p.name))
    return [r for f in folders if (f / "monitor.jsonl").is_file() for r in read_jsonl(f / "monitor.jsonl")]


def show(run_dir: str | Path, version: int | None = None, limit: int = 10, only: str | None = None,
         colour: bool = True) -> str:
    recs = load_trajectories(run_dir, version)
    if only == "success":
        recs = [r for r in recs if r["success"]]
    elif only == "fail":
        recs = [r for r in recs if not r["success"]]
    return "\n".join(render(r, colour) for r in recs[-limit:]) if recs else "no trajectories\n"
