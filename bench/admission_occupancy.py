#!/usr/bin/env python
"""How many rows an async producer's engine actually decodes when it admits whole GRPO groups (no model, no torch).

Why: with scheduler.max_staleness=2 and 8 prompts x 8 samples a step, the admission rule lets 24 groups (192 rows)
run at once, but a group counts as running until its slowest sample ends. With long-tailed lengths most of a
running group's rows are already done. This simulates the rule in decode steps: every live row advances one token
per step, a finished group is replaced at once (a producer that is never held), and a sync batch of the same groups
starts together and ends with its slowest sample. It prints the mean live rows and samples finished per decode
step of each, so an async run's `engine/rows_per_step` can be read against what admission allows.

Lengths (default): SmolLM2-135M-Instruct's first steps on the arithmetic task under a 512-token cap, roughly: 9% at
the cap, the rest uniform in 20-100 tokens (mean ~100 overall).

    python3 bench/admission_occupancy.py --out bench/results/admission_occupancy.json
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def draw(rng: random.Random, cap: int, cap_frac: float, low: int, high: int) -> int:
    return cap if rng.random() < cap_frac else rng.randint(low, high)


def producer(groups: int, group_size: int, steps: int, lengths) -> dict:
    """`groups` always running, each replaced by a fresh one the step its slowest sample ends."""
    running = [[lengths() for _ in range(group_size)] for _ in range(groups)]
    ages = [0] * groups
    live = finished = 0
    for _ in range(steps):
        for i, group in enumerate(running):
            ages[i] += 1
            live += sum(length >= ages[i] for length in group)
            if ages[i] >= max(group):
                finished += group_size
                running[i], ages[i] = [lengths() for _ in range(group_size)], 0
    return {"live_rows": live / steps, "samples_per_decode_step": finished / steps}


def sync(groups: int, group_size: int, batches: int, lengths) -> dict:
    """Batches of `groups` groups that start together and end with their slowest sample."""
    tokens = steps = 0
    for _ in range(batches):
        batch = [lengths() for _ in range(groups * group_size)]
        tokens, steps = tokens + sum(batch), steps + max(batch)
    return {"live_rows": tokens / steps, "samples_per_decode_step": groups * group_size * batches / steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8, help="prompt groups per training step")
    p.add_argument("--group", type=int, default=8, help="samples per group")
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 2, 5])
    p.add_argument("--cap", type=int, default=512)
    p.add_argument("--cap-frac", type=float, default=0.09)
    p.add_argument("--low", type=int, default=20)
    p.add_argument("--high", type=int, default=100)
    p.add_argument("--steps", type=int, default=20000, help="simulated decode steps per producer setting")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    rng = random.Random(a.seed)

    def lengths() -> int:
        return draw(rng, a.cap, a.cap_frac, a.low, a.high)

    result = {"workload": vars(a), "sync": sync(a.batch, a.group, max(1, a.steps // a.cap), lengths),
              "producer": {str(s): {"groups_running": (s + 1) * a.batch,
                                    **producer((s + 1) * a.batch, a.group, a.steps, lengths)}
                           for s in a.staleness}}
    for r in result["producer"].values():
        r["vs_sync"] = r["samples_per_decode_step"] / result["sync"]["samples_per_decode_step"]
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
