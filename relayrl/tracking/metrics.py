"""Run metrics: one JSONL line per step (crash-safe appends), TensorBoard scalars, a console table."""

from __future__ import annotations

import math
from pathlib import Path

from relayrl.common.utils import append_jsonl

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
    def __init__(self, run_dir: str | Path, tensorboard: bool = True):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        self._rows = 0

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and math.isfinite(v)}
        append_jsonl(self.path, {"step": step, **clean})
        if self._tb is not None:
            for k, v in clean.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()

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
        if self._tb is not None:
            self._tb.close()
