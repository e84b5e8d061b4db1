"""Run logs across resumes: a resume never deletes or truncates away what a run wrote.

A resumed run trains the steps after its checkpoint again, so the lines its logs got after that checkpoint
(metrics.jsonl, trajectories/*) would appear twice, and a crash may have torn the last one. Those bytes are
moved, not cut: to RUN_DIR/superseded/<k>-after-step_<N>/, under the same relative paths, and the live logs
continue from their size at the checkpoint, so each step appears once in them. A side file is written whole
(temp file + rename) before its log is cut back: a crash in between leaves the tail in both places (the next
resume sets it aside again), never in neither.

`run.resume=auto` on a folder with no complete checkpoint starts at step 0 in that folder (a job scheduler
restarting the same command must find the same folder); everything the earlier attempt left there but its
checkpoints/ folder (config.yaml, logs, tensorboard/, a saved model/) is moved to superseded/<k>-after-step_0/.
"""

from __future__ import annotations

import os
from pathlib import Path

from relayrl.common.files import atomic_write_bytes
from relayrl.run.lock import LOCK_FILE

SUPERSEDED = "superseded"
_KEEP_IN_PLACE = {"checkpoints", SUPERSEDED, LOCK_FILE}  # the lock file is held by the resuming run itself


def log_files(run_dir: Path) -> list[Path]:
    traj = run_dir / "trajectories"
    files = [run_dir / "metrics.jsonl", *(sorted(traj.rglob("*")) if traj.is_dir() else [])]
    return [f for f in files if f.is_file()]


def log_sizes(run_dir: Path) -> dict[str, int]:
    """Appends are whole lines (one write each), so these sizes always end on a line boundary."""
    return {str(f.relative_to(run_dir)): f.stat().st_size for f in log_files(run_dir)}


def set_aside_after(run_dir: Path, sizes: dict[str, int], step: int) -> Path | None:
    """Move what the logs got after the checkpoint of `step` (`sizes`: theirs then) to a superseded/ folder;
    returns that folder, or None if there was nothing to move."""
    side = None
    for f in log_files(run_dir):
        rel = f.relative_to(run_dir)
        size = sizes.get(str(rel))
        if size is not None and f.stat().st_size <= size:
            continue
        side = side or _new_side_folder(run_dir, step)
        dest = side / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        if size is None:  # written after the checkpoint: the whole file goes
            os.rename(f, dest)
            continue
        with open(f, "rb") as fh:
            fh.seek(size)
            tail = fh.read()
        atomic_write_bytes(dest, tail)
        os.truncate(f, size)
    _remove_empty_dirs(run_dir / "trajectories")
    return side


def set_aside_all(run_dir: Path) -> Path | None:
    """A fresh start in a used folder: move everything but checkpoints/ and superseded/ aside (see module doc)."""
    entries = sorted(e for e in run_dir.iterdir() if e.name not in _KEEP_IN_PLACE) if run_dir.is_dir() else []
    if not entries:
        return None
    side = _new_side_folder(run_dir, 0)
    for e in entries:
        os.rename(e, side / e.name)
    return side


def _new_side_folder(run_dir: Path, step: int) -> Path:
    root = run_dir / SUPERSEDED
    root.mkdir(parents=True, exist_ok=True)
    k = 1 + sum(1 for p in root.iterdir() if p.is_dir())
    while (root / f"{k}-after-step_{step}").exists():
        k += 1
    side = root / f"{k}-after-step_{step}"
    side.mkdir()
    return side


def _remove_empty_dirs(root: Path) -> None:
    """Folders emptied by moving their files away (a policy version trained only after the checkpoint)."""
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        if d.is_dir() and not any(d.iterdir()):
            d.rmdir()
