"""The judge's start-up trial: each batched reward function is called once, in a judge worker, on a few real
dataset rows, before any generation, so that a function returning the wrong number of values (or not a list of
numbers) stops the run with one line naming it, instead of rejecting every batch of the run.

Why in a worker and not in the parent: user code may crash the interpreter (`os._exit`, a C extension); in a worker
that costs the worker, which the pool replaces, never the run. Why the completions are empty strings: every
dataset has them (not every one has an answer column), an empty reply is a real model output (EOS first) that the
function must take anyway, and no function can short-circuit on a placeholder that happens to be right.

Only the shape is fatal: a list of `len(batch)` numbers or Nones. A function that raises, hangs, crashes its
worker or returns NaN on empty completions may still be right on real ones (it parses something that is not
there), so those are warnings: the run goes on, and the same failure on a real batch rejects that batch as always.
Row functions `(response, row)` are not tried: they return one value per call, so there is no count to get wrong.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from relayrl.common.errors import InputError
from relayrl.judge.functions import BATCHED, RewardFunction, RewardRejected, batch_arguments, batch_values
from relayrl.judge.pool import RemoteError, TimeoutPool, WorkerCrashed

logger = logging.getLogger(__name__)

TRIAL_SAMPLES = 3  # three, so a function that returns a fixed-length list (1 or 2 values) is caught


def trial_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """TRIAL_SAMPLES rows: the first ones, repeated when the dataset is smaller (GRPO groups repeat rows too)."""
    return [rows[i % len(rows)] for i in range(TRIAL_SAMPLES)] if rows else []


async def trial(functions: Sequence[RewardFunction], pool: TimeoutPool, rows: Sequence[dict[str, Any]],
                kwargs: dict[str, Any], timeout: float, bound: float | None) -> None:
    """Call every batched function once on `rows` with empty completions; raise InputError (one line, naming the
    function and its file:line) if one returns the wrong shape, log a warning for any other failure."""
    batched = [f for f in functions if f.style == BATCHED]
    if not batched or not rows:
        return
    problems = await asyncio.gather(*(_try(f, pool, list(rows), kwargs, timeout, bound) for f in batched))
    fatal = next((p for p in problems if p is not None and p[0]), None)
    for problem in problems:
        if problem is not None and not problem[0]:
            logger.warning("%s", problem[1])
    if fatal is not None:
        raise InputError(fatal[1])


async def _try(f: RewardFunction, pool: TimeoutPool, rows: list[dict[str, Any]], kwargs: dict[str, Any],
               timeout: float, bound: float | None) -> tuple[bool, str] | None:
    """None if f passed, else (fatal, one line)."""
    n = len(rows)
    args = batch_arguments(f, [""] * n, rows, [[] for _ in rows], kwargs)
    on = f"in its start-up trial ({n} dataset rows with empty completions)"
    who = f"reward function {f.name} ({f.where})"
    goes_on = "the run goes on, and a batch where it does so is rejected"
    try:
        out = await pool.call("relayrl.judge.functions:call_batched", (f.path, args), timeout=timeout)
        batch_values(out, n, bound)
    except RewardRejected as e:
        if e.reason == "invalid":  # the wrong count, not a list, or a value that is not a number: wrong everywhere
            return True, f"judge.reward_fn: {who} {e}, {on}"
        return False, f"{who} {e}, {on}; {goes_on}"
    except RemoteError as e:
        return False, f"{who} raised {e.exc_type}, {on}: {' '.join(e.message.split())[:200]}; {goes_on}"
    except TimeoutError:
        return False, f"{who} did not answer within judge.timeout={timeout:g}s, {on}; its worker was replaced"
    except WorkerCrashed as e:
        if "failed to start" in str(e):  # its module does not load in a worker: wait_ready's error, raised now
            raise
        return False, f"{who} crashed its worker, {on}: {' '.join(str(e).split())}; the worker was replaced"
    return None
