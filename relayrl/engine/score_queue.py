"""`ScoreQueue`: the scorings LocalEngine.submit_score queued, run by the engine's worker between two steps.

Scoring is one plain forward over a sequence (relayrl.engine.scoring), so it must not race a decode step or a weight
update: the worker takes queued scorings at the start of a step and runs them before decoding. It takes at most
about one prefill's worth of tokens per step (at least one scoring), so a stream of scorings delays each decode step
by about one prefill and never starves the running batch.
"""

from __future__ import annotations

import concurrent.futures
from collections import deque

import torch

from relayrl.engine.scoring import score_forward

ScoreJob = tuple[list[int], int, float, concurrent.futures.Future]  # ids, top_k, temperature, the caller's future


class ScoreQueue:
    """Scorings waiting for the worker; the engine's condition guards it."""

    def __init__(self) -> None:
        self.jobs: deque[ScoreJob] = deque()

    def __len__(self) -> int:
        return len(self.jobs)

    @staticmethod
    def check(input_ids: list[int], top_k: int, temperature: float, max_seq_len: int) -> None:
        """A scoring the engine can run, or ValueError saying why not."""
        if not input_ids:
            raise ValueError("input_ids is empty")
        if len(input_ids) > max_seq_len:
            raise ValueError(f"{len(input_ids)} tokens do not fit max_seq_len={max_seq_len}")
        if top_k < 0 or not temperature > 0:
            raise ValueError(f"top_k must be >= 0 and temperature > 0, got {top_k} and {temperature}")

    def put(self, input_ids: list[int], top_k: int, temperature: float) -> concurrent.futures.Future:
        """Queue one checked scoring; its future resolves to (logprobs, alternatives) (LocalEngine.submit_score)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.jobs.append((list(input_ids), top_k, temperature, future))
        return future

    def take(self, budget: int) -> list[ScoreJob]:
        """The scorings for this step: up to `budget` tokens, at least one (module doc)."""
        taken, tokens = [], 0
        while self.jobs and (not taken or tokens + len(self.jobs[0][0]) <= budget):
            taken.append(self.jobs.popleft())
            tokens += len(taken[-1][0])
        return taken

    @staticmethod
    def run(model: torch.nn.Module, jobs: list[ScoreJob]) -> int:
        """Run the taken scorings under `model`; the tokens scored. A failed scoring fails its caller, not the
        engine; a caller that gave up is skipped."""
        scored = 0
        for ids, top_k, temperature, future in jobs:
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(score_forward(model, ids, top_k, temperature))
                scored += len(ids)
            except Exception as e:
                future.set_exception(e)
        return scored

    def fail(self, error: Exception) -> None:
        """Fail every queued scoring (the engine closed) and empty the queue."""
        for *_, future in self.jobs:
            if not future.done():
                future.set_exception(error)
        self.jobs.clear()
