"""Run metrics: every step's row to each tracker of run.trackers (metrics.jsonl always), and a console table."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from relayrl.common.errors import close_all
from relayrl.config import to_dict
from relayrl.config.trackers import DEFAULT_TRACKERS, WandbConfig
from relayrl.tracking.trackers import active_trackers, make_trackers

# (metric key(s), column title, format) shown in the per-step console table; the first key present wins
COLUMNS = [
    ("rollout/reward_mean", "reward", "{:7.3f}"),
    ("rollout/pass_rate", "pass", "{:6.1%}"),
    ("rollout/response_len_mean", "len", "{:6.1f}"),
    ("rollout/truncated_frac", "trunc", "{:6.1%}"),
    ("train/entropy", "entropy", "{:7.3f}"),
    ("train/clip_frac", "clip", "{:6.3f}"),
    (("train/kl_ref", "train/approx_kl_old"), "kl", "{:7.4f}"),
    ("train/grad_norm", "gnorm", "{:7.3f}"),
    ("time/rollout_s", "t_roll", "{:7.1f}"),
    ("time/train_s", "t_train", "{:7.1f}"),
    ("perf/rollout_tokens_per_s", "gen tok/s", "{:9.1f}"),
]


class MetricsLogger:
    """Fans each row of metrics out to the run's trackers (relayrl/tracking/trackers.py), metrics.jsonl first,
    and formats the console table."""

    def __init__(self, run_dir: str | Path, trackers: Iterable[str] = DEFAULT_TRACKERS,
                 config: dict[str, Any] | None = None, mlflow_uri: str = "", wandb: WandbConfig | None = None):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self.names = active_trackers(trackers)
        self.trackers = make_trackers(self.names, self.run_dir, mlflow_uri, wandb)
        if config is not None:
            for tracker in self.trackers:
                tracker.log_config(config)
        self._rows = 0

    @classmethod
    def for_run(cls, run_dir: str | Path, cfg: Any) -> MetricsLogger:
        """The logger a run's config asks for (run.trackers, run.tensorboard, run.mlflow_uri, run.wandb), which
        records the resolved config in each tracker. run.offline promises no network: wandb's auto mode is then
        offline."""
        names = active_trackers(cfg.run.trackers, tensorboard=cfg.run.tensorboard)
        wandb = cfg.run.wandb
        if cfg.run.offline and wandb.mode == "auto":
            wandb = dataclasses.replace(wandb, mode="offline")
        return cls(run_dir, names, config=to_dict(cfg), mlflow_uri=cfg.run.mlflow_uri, wandb=wandb)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """The same finite values at the same step to every tracker (NaN/inf and non-numbers are dropped)."""
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and math.isfinite(v)}
        for tracker in self.trackers:
            tracker.log(step, clean)

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """A few of the step's samples ({step, prompt, completion, reward} each) to every tracker; none: nothing."""
        if rows:
            for tracker in self.trackers:
                tracker.log_samples(step, rows)

    def outputs(self) -> list[str]:
        """Where each tracker writes, as the start block shows it: `name (location)`."""
        return [f"{name} ({tracker.location})" for name, tracker in zip(self.names, self.trackers, strict=True)]

    def table_row(self, step: int, metrics: dict[str, float]) -> str:
        """One fixed-width row of the step table (with the header every 20 rows)."""
        cells = [f"{step:>5}"]
        for keys, _, fmt in COLUMNS:
            v = next((metrics[k] for k in ((keys,) if isinstance(keys, str) else keys) if k in metrics), None)
            width = len(fmt.format(0.0))
            cells.append(fmt.format(v) if v is not None else "-".rjust(width))
        row = " ".join(cells)
        if self._rows % 20 == 0:
            header = " ".join(["step".rjust(5)] + [title.rjust(len(fmt.format(0.0))) for _, title, fmt in COLUMNS])
            row = header + "\n" + row
        self._rows += 1
        return row

    def close(self) -> None:
        """Close every tracker, each even if another fails (the first error is raised after)."""
        close_all([tracker.close for tracker in self.trackers])
