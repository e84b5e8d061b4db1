"""The judge's start-up trial (relayrl/judge/trial.py): before the first rollout, each batched reward function runs
once in a real judge worker on dataset rows with empty completions. The wrong shape stops the run with one line
naming the function and its file:line; a raise, hang, crash or NaN on those placeholders is a warning and costs
at most a worker. Functions live in tests/trial_rewards_for_tests.py and tests/trl_rewards_for_tests.py."""

from __future__ import annotations

import asyncio
import inspect
import logging

import pytest
import trial_rewards_for_tests as tr
import trl_rewards_for_tests as trl
from conftest import tiny_run_args, write_sums

from relayrl.cli import main
from relayrl.common.errors import InputError
from relayrl.judge import Judge
from relayrl.sample import Sample

ROWS = [{"question": "What is 1 + 1?", "answer": "2"}, {"question": "What is 2 + 2?", "answer": "4"}]


def _where(fn) -> str:
    return f"{fn.__name__} ({inspect.getsourcefile(fn)}:{fn.__code__.co_firstlineno})"


@pytest.mark.parametrize(("fn", "says"), [
    (trl.short_reward, "returned 2 values for 3 completions"),
    (tr.fixed_two, "returned 2 values for 3 completions"),  # right for batches of two: 3 trial samples catch it
    (trl.scalar_reward, "returned a float, expected a list of 3 values (one per completion), in its start-up trial"),
    (tr.text_values, "returned a invalid reward: '1.0', in its start-up trial"),
])
def test_the_wrong_shape_fails_wait_ready_naming_function_and_line(fn, says: str):
    with Judge([trl.format_reward, fn], workers=1) as judge:
        judge.start(ROWS)
        with pytest.raises(InputError) as e:
            judge.wait_ready()
        assert judge.calls == 0  # nothing was scored: the trial is not a batch of the run
    message = str(e.value)
    assert message.startswith(f"judge.reward_fn: reward function {_where(fn)} {says}")
    assert "start-up trial" in message and "\n" not in message


def test_failures_on_empty_completions_warn_cost_a_worker_and_the_run_goes_on(caplog):
    fns = [tr.first_word, tr.crash_on_empty, tr.hang_on_empty, tr.nan_on_empty, tr.sees_rows]
    with Judge(fns, workers=2, timeout=1.0) as judge, caplog.at_level(logging.WARNING, "relayrl.judge.trial"):
        judge.start(ROWS)
        judge.wait_ready()
        warnings = [r.getMessage() for r in caplog.records]
        for fn, says in [(tr.first_word, "raised IndexError"), (tr.crash_on_empty, "crashed its worker"),
                         (tr.hang_on_empty, "did not answer within judge.timeout=1s"),
                         (tr.nan_on_empty, "returned a nonfinite reward")]:
            assert sum(_where(fn) in w and says in w for w in warnings) == 1, (fn.__name__, warnings)
        assert len(warnings) == 4  # sees_rows got the rows' answer column and passed
        assert len(judge.pool.worker_pids()) == 2  # the crashed and the hung worker were replaced

        async def real_batch() -> list[Sample]:
            samples = [Sample(prompt_ids=[1], data=dict(row), response_text="four 4") for row in ROWS]
            return await asyncio.gather(*(judge.judge(s) for s in samples))

        assert [s.reward for s in asyncio.run(real_batch())] == [4.0, 4.0]  # 1 + 1 + 1 + 1 + 0 per sample


def test_a_run_whose_reward_returns_the_wrong_count_exits_2_before_generating(tiny_path, tmp_path, capsys):
    data = write_sums(tmp_path / "d.jsonl", 4)
    args = tiny_run_args(tiny_path, data, tmp_path / "runs",
                         **{"judge.reward_fn": "trl_rewards_for_tests:short_reward"})
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: judge.reward_fn: reward function {_where(trl.short_reward)} returned 2 "
                              f"values for 3 completions"), err
    assert "Traceback" not in "\n".join(err)
    assert not (tmp_path / "runs").exists()  # no step ran, and the new run folder is undone
