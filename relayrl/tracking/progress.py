"""Training progress as a person reads it: a live bar on a terminal, one plain line per step anywhere else.

A tqdm bar redraws itself with carriage returns; in a log file or a job scheduler's captured output that is
noise, and a disabled bar says nothing at all. So where stderr is not a terminal each step prints one flushed
line instead: `step 3/30 | 0:01:12 elapsed | ETA 0:09:40 | reward 0.41 | pass 38.0% | ...`, which `tail -f`
and `grep` read. The run's start block (model, data, where outputs go) is printed once before the first step;
its first line, the precision line, is printed by relayrl/run/precision.py `resolve_precision` before the models
load, so it is not repeated here.
"""

from __future__ import annotations

import datetime
import sys
import time
from collections.abc import Iterator
from typing import Any, TextIO

from tqdm import tqdm

from relayrl.models.loading import resolve_model_path

# (metric key(s), label, format) in the per-step line, shown when present; the first key present wins
LINE_FIELDS = [
    ("rollout/reward_mean", "reward", "{:.3g}"),
    ("rollout/pass_rate", "pass", "{:.1%}"),
    ("rollout/response_len_mean", "len", "{:.1f}"),
    (("train/kl_ref", "train/approx_kl_old"), "kl", "{:.4f}"),
]


def clock(seconds: float) -> str:
    """H:MM:SS (whole seconds)."""
    return str(datetime.timedelta(seconds=max(0, round(seconds))))


class Progress:
    """Iterates the steps after `first` up to `total`, showing progress after each one (`show`).

    On a terminal it is the tqdm bar (with reward and pass rate after it); otherwise one line per step on the
    same stream. The ETA is the mean time of the steps this process has run (evaluations and checkpoints
    included, as they will be for the steps left) times the steps left.
    """

    def __init__(self, first: int, total: int, stream: TextIO | None = None, live: bool | None = None):
        self.first, self.total = first, total
        self.stream = stream if stream is not None else sys.stderr
        self.live = self.stream.isatty() if live is None else live
        self._bar = (tqdm(range(first + 1, total + 1), desc="train", unit="step", dynamic_ncols=True, initial=first,
                          total=total, file=self.stream) if self.live else None)
        self._t0 = time.monotonic()

    def __iter__(self) -> Iterator[int]:
        self._t0 = time.monotonic()
        yield from (self._bar if self._bar is not None else range(self.first + 1, self.total + 1))

    def show(self, step: int, metrics: dict[str, float]) -> None:
        """After a step: the bar's postfix on a terminal, else the step's line, flushed at once."""
        if self._bar is not None:
            self._bar.set_postfix(reward=f"{metrics.get('rollout/reward_mean', 0):.3f}",
                                  pass_=f"{metrics.get('rollout/pass_rate', 0):.2f}")
            return
        print(self.line(step, metrics, time.monotonic() - self._t0), file=self.stream, flush=True)

    def line(self, step: int, metrics: dict[str, float], elapsed: float) -> str:
        """`step 3/30 | 0:01:12 elapsed | ETA 0:09:40 | reward 0.41 | pass 38.0% | ... | 24.0 s/step`."""
        per_step = elapsed / max(1, step - self.first)
        eta = per_step * (self.total - step)
        parts = [f"step {step}/{self.total}", f"{clock(elapsed)} elapsed", f"ETA {clock(eta)}"]
        for keys, label, fmt in LINE_FIELDS:
            v = next((metrics[k] for k in ((keys,) if isinstance(keys, str) else keys) if k in metrics), None)
            if v is not None:
                parts.append(f"{label} {fmt.format(v)}")
        parts.append(f"{per_step:.1f} s/step")
        return " | ".join(parts)


def start_block(c: Any) -> str:
    """What the run is about to do and where it writes, for a run's Components `c` (model, data sizes, run
    folder and trackers); the precision line before it comes from the build."""
    cfg = c.cfg
    path = resolve_model_path(cfg.model.path, prepare=False)
    model = cfg.model.path if path == cfg.model.path else f"{cfg.model.path} ({path})"
    train = (f"train {len(c.data)} prompts, {cfg.data.batch_size} x {cfg.data.group_size} samples per step"
             if c.data is not None else "train prompts in the producer process")
    evals = f"eval {len(c.eval_data)} prompts x {cfg.eval.n}" if c.eval_data is not None else "no eval set"
    if c.eval_data is None and c.data is None and cfg.data.eval:  # a producer process holds both
        evals = "eval in the producer process"
    outs = c.logger.outputs() if c.logger is not None else []
    return "\n".join([f"model: {model}", f"data: {train}; {evals}; {cfg.run.steps} steps",
                      f"outputs: {c.run_dir} | trackers: {', '.join(outs)}"])
