"""Success by turn and the fresh-attempt rate of multi-turn samples, by hand."""

from __future__ import annotations

import pytest

from relayrl.run.evaluator import fresh_attempt_rate, rollout_metrics
from relayrl.sample import Sample


def _samples(group: str, solved: list[int], turns: list[int], planted: bool = False) -> list[Sample]:
    return [Sample(prompt_ids=[1], group_id=group, index=i, reward=0.0,
                   metrics={"solved_turn": float(s), "turns": float(t), "correct": float(s > 0),
                            "planted": float(planted)})
            for i, (s, t) in enumerate(zip(solved, turns))]


def test_fresh_attempt_rate_is_the_groups_other_first_turns_over_the_samples_that_retried():
    batch = (_samples("a", [1, 1, 2, 0], [1, 1, 2, 3])      # 2 retried; 2 of the other 3 right at turn 1: 2/3 each
             + _samples("b", [0, 3, 1, 0], [3, 3, 1, 3])    # 3 retried; 1 of the other 3: 1/3 each
             + _samples("c", [0], [3]))                     # alone: nothing to compare with
    assert fresh_attempt_rate(batch, "eval") == {"eval/fresh_at_turn_2": pytest.approx((2 / 3 * 2 + 1 / 3 * 3) / 5)}
    m = rollout_metrics(batch, "eval")
    assert m["eval/fresh_at_turn_2"] == pytest.approx(7 / 15)
    assert m["eval/recovered_at_turn_2"] == pytest.approx(1 / 6)  # 1 solved at turn 2 of the 6 that reached it


def test_planted_samples_and_single_turn_batches_have_no_fresh_rate():
    planted = _samples("p", [0, 2, 0, 3], [3, 2, 3, 3], planted=True)
    m = rollout_metrics(_samples("a", [1, 0], [1, 2]) + planted, "eval")
    assert m["eval/fresh_at_turn_2"] == 1.0  # only the natural group: its other sample was right at turn 1
    assert "eval/planted/fresh_at_turn_2" not in m  # a planted turn 1 is never right: no fresh attempt to compare
    assert fresh_attempt_rate([Sample(prompt_ids=[1], group_id="g", metrics={"correct": 1.0})], "eval") == {}
