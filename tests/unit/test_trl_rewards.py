"""Rewards as TRL users write them: batched `fn(prompts, completions, **columns)`, several with weights, None for
"no reward here", async functions; batches that fail cost their samples only. Real worker processes throughout
(the functions live in tests/trl_rewards_for_tests.py); every reward is checked against a hand-computed value."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

import pytest

TESTS_DIR = str(Path(__file__).resolve().parents[1])
if TESTS_DIR not in sys.path:  # workers import the reward modules by path; spawn hands them our sys.path
    sys.path.insert(0, TESTS_DIR)

import rewards_for_tests  # noqa: E402
import trl_rewards_for_tests as trl  # noqa: E402

from relayrl.config import ConfigError  # noqa: E402
from relayrl.config.schema import load_run_config  # noqa: E402
from relayrl.judge import BATCHED, ROW, Judge, arguments_problem, math_reward, style_of  # noqa: E402
from relayrl.run.evaluator import rollout_metrics  # noqa: E402
from relayrl.sample import Sample  # noqa: E402

M = "trl_rewards_for_tests:"
FILE = trl.__file__


def _sample(response: str, ids: list[int] | None = None, **row: object) -> Sample:
    return Sample(prompt_ids=[1, 2, 3], data=dict(row), response_text=response, response_ids=list(ids or []))


def _judge_all(judge: Judge, samples: list[Sample]) -> list[Sample]:
    """Judge the samples concurrently, as a group's agents do: calls made together are batched together."""
    async def main() -> list[Sample]:
        return await asyncio.gather(*(judge.judge(s) for s in samples))

    return asyncio.run(main())


def _rejected(s: Sample) -> str | None:
    return next((k.removeprefix("judge_rejected_") for k, v in s.metrics.items()
                 if k.startswith("judge_rejected_") and v), None)


# ---- which kind a function is ---------------------------------------------------------------------------
def test_the_signature_says_which_kind():
    def only_kwargs(**kwargs):
        return []

    assert [style_of(f) for f in (trl.format_reward, trl.length_reward, trl.echo_reward, trl.only_named,
                                  trl.async_reward, only_kwargs)] == [BATCHED] * 6
    assert [style_of(f) for f in (math_reward, rewards_for_tests.parity_reward, rewards_for_tests.tagged_reward,
                                  len)] == [ROW] * 4


# ---- rewards by hand -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mixed():
    """Three batched functions with weights, and relayrl's (response, row) parity_reward among them."""
    judge = Judge([M + "format_reward", M + "length_reward", M + "answer_reward", "rewards_for_tests:parity_reward"],
                  reward_weights=[1.0, 0.5, 2.0, -1.0], workers=2)
    yield judge
    judge.close()


def test_weighted_sum_none_and_per_function_metrics(mixed: Judge):
    out = _judge_all(mixed, [_sample("42!", question="q", answer="42"),   # format 1, length .3, answer 1, even 0
                             _sample("41", question="q", answer="42"),    # format 0, length .2, answer 0, even 1
                             _sample("ab!c", question="q")])              # format 0, length .4, answer None, even 1
    assert [s.reward for s in out] == pytest.approx([1 + 0.15 + 2, 0.1 - 1, 0.2 - 1])
    assert out[0].metrics == pytest.approx({"reward/format_reward": 1.0, "reward/length_reward": 0.3,
                                            "reward/answer_reward": 1.0, "reward/parity_reward": 0.0, "correct": 0.0,
                                            "reward": 3.15, "judge_failed": 0.0})
    assert "reward/answer_reward" not in out[2].metrics  # None: no value, not a zero
    assert out[2].metrics["reward_none/answer_reward"] == 1.0  # but counted, per function
    rollout = rollout_metrics(out)
    assert rollout["rollout/reward_none/answer_reward_mean"] == pytest.approx(1 / 3)
    assert rollout["rollout/reward/answer_reward_mean"] == pytest.approx(0.0 / 2 + 1.0 / 2)  # where it gave one
    assert all(s.error is None and _rejected(s) is None for s in out)


def test_every_function_none_rejects_the_sample():
    with Judge([M + "none_reward", M + "answer_reward"], workers=1) as judge:
        calls, failures = judge.calls, judge.failures
        lone, answered = _judge_all(judge, [_sample("7", question="q"), _sample("7", question="q", answer="7")])
        assert _rejected(lone) == "no_reward" and lone.reward == 0.0 and lone.metrics["judge_failed"] == 1.0
        assert "every reward function returned None" in lone.error and "none_reward, answer_reward" in lone.error
        assert answered.reward == 1.0 and _rejected(answered) is None  # one None among values: the others count
        assert (judge.calls, judge.failures) == (calls + 2, failures + 1)


def test_trl_arguments_standard_and_conversational():
    """completion_ids are the response's tokens; a chat-message prompt makes completions chat messages (+100)."""
    chat = [{"role": "user", "content": "hi"}]
    with Judge(M + "echo_reward", workers=1) as judge:
        text, conv = _judge_all(judge, [_sample("a", ids=[5, 6, 7, 8], question="hi"),
                                        _sample("b", ids=[5, 6], question="hi", prompt_messages=chat)])
    assert (text.reward, conv.reward) == (2.0, 101.0)


def test_async_function_and_only_named_columns():
    with Judge([M + "async_reward", M + "only_named"], workers=1) as judge:
        s = _judge_all(judge, [_sample("x 9 !!", question="q", answer="9", extra="not for only_named")])[0]
    assert s.reward == 2 * 2.0 + 1.0 and s.metrics["reward/async_reward"] == 4.0


def test_judge_kwargs_reach_batched_functions_as_values():
    with Judge(M + "scaled_reward", reward_kwargs={"scale": 0.25}, workers=1) as judge:
        assert [s.reward for s in _judge_all(judge, [_sample("a"), _sample("b")])] == [0.25, 0.25]


# ---- batching ---------------------------------------------------------------------------------------------
def test_calls_made_together_are_batched_up_to_batch_size():
    with Judge(M + "batch_size_reward", workers=1, batch_size=3) as judge:
        out = _judge_all(judge, [_sample(str(i)) for i in range(8)])
        assert sorted(judge.batches.batch_sizes) == [2, 3, 3]
        assert sorted(s.reward for s in out) == [2.0] * 2 + [3.0] * 6
        one = _judge_all(judge, [_sample("alone")])[0]  # an idle judge does not wait for company
        assert one.reward == 1.0


# ---- failures cost their batch, never the run ---------------------------------------------------------------
def test_wrong_count_rejects_the_batch_naming_function_file_and_counts(caplog):
    with Judge(M + "short_reward", workers=1) as judge, caplog.at_level(logging.WARNING, "relayrl.judge.judge"):
        out = _judge_all(judge, [_sample(str(i)) for i in range(4)])
        assert judge.failures == 4
    assert [_rejected(s) for s in out] == ["invalid"] * 4
    assert all(s.reward == 0.0 and s.metrics["judge_failed"] == 1.0 for s in out)
    line = f"reward short_reward ({FILE}) returned 3 values for 4 completions (expected 4"
    assert all(line in s.error for s in out)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and line in warnings[0] and "4 samples" in warnings[0]  # one line per batch


@pytest.mark.parametrize(("fn", "text", "reason", "says"), [
    ("raising_reward", "boom", "error", "raised RuntimeError on a batch of 2 samples: boom in a completion"),
    ("crashing_reward", "crash", "crashed", "exited with code 3"),
    ("nan_reward", "nan", "nonfinite", "returned a nonfinite reward: nan"),
    ("scalar_reward", "x", "invalid", "returned a float, expected a list of 2 values"),
])
def test_a_failing_batch_costs_its_samples_and_the_judge_carries_on(fn: str, text: str, reason: str, says: str):
    with Judge(M + fn, workers=1) as judge:
        bad = _judge_all(judge, [_sample(text), _sample("fine")])
        assert [_rejected(s) for s in bad] == [reason, reason]
        assert all(says in s.error and f"{fn} ({FILE})" in s.error for s in bad)
        if fn != "scalar_reward":
            assert [s.reward for s in _judge_all(judge, [_sample("fine"), _sample("good")])] == [1.0, 1.0]


def test_a_hanging_batch_times_out_while_other_batches_are_scored():
    with Judge(M + "hanging_reward", workers=2, batch_size=2, timeout=1.0) as judge:
        judge.start()
        judge.wait_ready()
        out = _judge_all(judge, [_sample("ok"), _sample("hang"), _sample("ok"), _sample("ok")])
        assert [_rejected(s) for s in out] == ["timeout", "timeout", None, None]
        assert "timed out after 1s on a batch of 2 samples" in out[0].error
        assert [s.reward for s in _judge_all(judge, [_sample("ok")])] == [1.0]


def test_cancelling_every_caller_of_a_batch_stops_it():
    """Over-sampling cancels slow groups: their batch's worker is killed at once, not left running to the timeout."""
    async def main(judge: Judge) -> float:
        tasks = [asyncio.ensure_future(judge.judge(_sample("hang"))) for _ in range(2)]
        await asyncio.sleep(0.5)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        loop = asyncio.get_running_loop()
        start = loop.time()
        await judge.judge(s := _sample("ok"))
        assert s.reward == 1.0
        return loop.time() - start

    with Judge(M + "hanging_reward", workers=1, timeout=30.0) as judge:
        judge.start()
        judge.wait_ready()
        assert asyncio.run(main(judge)) < 15.0  # a fresh worker, not the hung one after its 30 s timeout


# ---- checks before any compute -------------------------------------------------------------------------------
def test_construction_checks_weights_names_and_kwargs():
    with pytest.raises(ValueError, match="reward_weights has 1 weights for 2 reward function"):
        Judge([M + "format_reward", M + "length_reward"], reward_weights=[1.0])
    with pytest.raises(ValueError, match="two reward functions are named 'format_reward'"):
        Judge([M + "format_reward", M + "format_reward"])
    with pytest.raises(TypeError, match=r"reward_kwargs\['scale'\]: unknown argument for reward function only_named"):
        Judge(M + "only_named", reward_kwargs={"scale": 1.0})


def test_required_columns_are_checked_against_the_rows():
    assert arguments_problem(trl.needs_column, M + "needs_column", {}, None) is None  # rows unknown yet
    assert arguments_problem(trl.needs_column, M + "needs_column", {}, {"question", "solution"}) is None
    name, why = arguments_problem(trl.needs_column, M + "needs_column", {}, {"question", "answer"})
    assert name == "" and f"needs_column ({FILE}) requires argument 'solution'" in why


def test_config_takes_a_list_with_weights_and_names_the_key():
    cfg = load_run_config(None, ["data.train.source=x.jsonl", f"judge.reward_fn=[{M}format_reward, {M}length_reward]",
                                 "judge.reward_weights=[1.0, 0.5]"])
    assert cfg.judge.reward_fn == [M + "format_reward", M + "length_reward"] and cfg.judge.reward_weights == [1, .5]
    with pytest.raises(ConfigError, match=r"^judge\.reward_weights: has 1 weights for 2 reward function"):
        load_run_config(None, ["data.train.source=x.jsonl", f"judge.reward_fn=[{M}format_reward, {M}length_reward]",
                               "judge.reward_weights=[1.0]"])
    with pytest.raises(ConfigError, match=r"^judge\.reward_fn: names no function"):
        load_run_config(None, ["data.train.source=x.jsonl", "judge.reward_fn=[]"])


def test_build_check_names_the_list_entry(tmp_path):
    from relayrl.run.build import check_user_code

    cfg = load_run_config(None, ["data.train.source=x.jsonl", f"judge.reward_fn=[{M}format_reward, {M}needs_column]"])
    with pytest.raises(ConfigError, match=r"^judge\.reward_fn\[1\]: reward function needs_column .* 'solution'"):
        check_user_code(cfg, [{"question": "q", "answer": "a"}])
    check_user_code(cfg, [{"question": "q", "solution": "a"}])


def test_api_names_importable_functions_by_path(tmp_path):
    from relayrl.api import code_path

    for fn in (trl.format_reward, trl.length_reward):  # importable: named by path, nothing pickled
        assert code_path(fn, tmp_path, "reward") == M + fn.__name__
    assert not list(tmp_path.iterdir())
