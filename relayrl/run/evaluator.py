"""`Evaluator` and batch metrics: what a set of finished samples says about the policy.

The Evaluator does not generate; it scores a batch the Env produced, so evaluation and training share one
rollout path. pass@k uses the
unbiased estimator 1 - C(n - c, k) / C(n, k) over n samples per prompt with c correct.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable

from relayrl.judge.math import final_answer
from relayrl.sample import Sample


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c correct) is correct."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _correct(s: Sample) -> float:
    """Correctness if the judge reported it, else reward > 0."""
    return float(s.metrics.get("correct", float((s.reward or 0.0) > 0)))


def groups_of(samples: list[Sample]) -> list[list[Sample]]:
    by_gid: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        by_gid[s.group_id].append(s)
    return list(by_gid.values())


def rollout_metrics(samples: list[Sample], prefix: str = "rollout") -> dict[str, float]:
    """Reward, pass rate, lengths, truncation and group diversity of a batch of finished samples (and success by
    turn for multi-turn agents)."""
    if not samples:
        return {f"{prefix}/samples": 0.0}
    rewards = [float(s.reward or 0.0) for s in samples]
    lengths = [len(s.response_ids) for s in samples]
    groups = groups_of(samples)
    mixed = [len({float(s.reward or 0.0) for s in g}) > 1 for g in groups]
    out = {
        f"{prefix}/reward_mean": statistics.fmean(rewards),
        f"{prefix}/reward_std": statistics.pstdev(rewards),
        f"{prefix}/pass_rate": statistics.fmean(_correct(s) for s in samples),
        f"{prefix}/response_len_mean": statistics.fmean(lengths),
        f"{prefix}/response_len_max": float(max(lengths)),
        f"{prefix}/truncated_frac": statistics.fmean(s.finish_reason == "length" for s in samples),
        f"{prefix}/groups_mixed_frac": statistics.fmean(mixed),
        f"{prefix}/samples": float(len(samples)),
        # every engine-made token, trained or not (an agent may keep some turns out of the loss)
        f"{prefix}/generated_tokens": float(sum(t.end - t.start for s in samples for t in s.turns)),
    }
    metric_keys = {k for s in samples for k in s.metrics} - {"reward", "correct"}
    for k in sorted(metric_keys):
        if k.startswith("reward/"):  # one reward function's value: the mean where it gave one (None: none), as TRL
            out[f"{prefix}/{k}_mean"] = statistics.fmean(float(s.metrics[k]) for s in samples if k in s.metrics)
        else:
            out[f"{prefix}/{k}_mean"] = statistics.fmean(float(s.metrics.get(k, 0.0)) for s in samples)
    planted = [s for s in samples if s.metrics.get("planted")]
    natural = [s for s in samples if not s.metrics.get("planted")]
    out |= turn_metrics(natural, prefix) | fresh_attempt_rate(natural, prefix)
    if planted:  # a planted first answer can never be solved at turn 1: its samples get their own success by turn
        out |= turn_metrics(planted, f"{prefix}/planted")
    return out


def turn_metrics(batch: list[Sample], prefix: str) -> dict[str, float]:
    """Multi-turn agents: the share solved at turn k, the share of those that reached turn k >= 2 solved there
    (recovery: the rate that says whether feedback helps, whatever turn 1's accuracy), and the share of retries
    that only repeated an earlier answer (agents that report `retries` and `repeats`)."""
    out: dict[str, float] = {}
    solved = [int(s.metrics["solved_turn"]) for s in batch if "solved_turn" in s.metrics]
    turns = [int(s.metrics.get("turns", 1)) for s in batch if "solved_turn" in s.metrics]
    for turn in range(1, max(solved, default=0) + 1):
        out[f"{prefix}/solved_at_turn_{turn}"] = solved.count(turn) / len(solved)
    for turn in range(2, max(turns, default=0) + 1):
        reached = sum(t >= turn for t in turns)
        out[f"{prefix}/recovered_at_turn_{turn}"] = solved.count(turn) / reached
    retries = sum(float(s.metrics.get("retries", 0.0)) for s in batch)
    if retries:
        out[f"{prefix}/retry_repeat_rate"] = sum(float(s.metrics.get("repeats", 0.0)) for s in batch) / retries
    return out


def fresh_attempt_rate(batch: list[Sample], prefix: str) -> dict[str, float]:
    """What a fresh first attempt scores on the questions whose samples had to retry: over the samples that reached
    turn 2, the mean turn-1 success of the other samples of their group (same question). `recovered_at_turn_2`
    above it means the retry, with its failed attempt and the feedback in context, beats asking again; below it,
    the context hurts (docs/benchmarks.md, "Learning: the reflection agent"). Groups of one sample say nothing."""
    rates = []
    for g in groups_of([s for s in batch if "solved_turn" in s.metrics]):
        first = sum(int(s.metrics["solved_turn"]) == 1 for s in g)
        rates += [first / (len(g) - 1) for s in g if len(g) > 1 and int(s.metrics.get("turns", 1)) >= 2]
    return {f"{prefix}/fresh_at_turn_2": statistics.fmean(rates)} if rates else {}


def majority_correct(group: list[Sample], answer_fn: Callable[[str], str | None]) -> float:
    """1.0 if the most common final answer of the group is a correct one (ties: the first seen wins)."""
    votes: Counter[str] = Counter()
    correct: dict[str, float] = {}
    for s in group:
        ans = answer_fn(s.response_text)
        if ans is not None:
            votes[ans] += 1
            correct.setdefault(ans, _correct(s))
    return correct[votes.most_common(1)[0][0]] if votes else 0.0


class Evaluator:
    """Metrics of an eval batch: mean reward, pass@1, unbiased pass@k and maj@k for k = 1, 2, 4, ... <= n
    samples per prompt, and for multi-turn agents success by turn (`turn_metrics`).

    maj@k votes over the first k samples of each prompt, using `answer_fn` to read a sample's final answer
    (for multi-turn samples, the text of the whole trajectory: its last answer counts).
    """

    def __init__(self, answer_fn: Callable[[str], str | None] = final_answer):
        self.answer_fn = answer_fn

    def evaluate(self, batch: list[Sample], prefix: str = "eval") -> dict[str, float]:
        out = rollout_metrics(batch, prefix)
        groups = groups_of(batch)
        if not groups:
            return out
        n = min(len(g) for g in groups)
        k = 1
        while k <= n:
            out[f"{prefix}/pass@{k}"] = statistics.fmean(
                pass_at_k(len(g), int(sum(_correct(s) for s in g)), k) for g in groups)
            out[f"{prefix}/maj@{k}"] = statistics.fmean(majority_correct(g[:k], self.answer_fn) for g in groups)
            k *= 2
        return out
