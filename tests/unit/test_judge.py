"""Tests for relayrl.judge: the math reward, the timeout pool and the Judge, with real worker processes."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from bounds import bound

TESTS_DIR = str(Path(__file__).resolve().parents[1])
if TESTS_DIR not in sys.path:  # workers import `judge_fns` by path; spawn hands them our sys.path
    sys.path.insert(0, TESTS_DIR)

import judge_fns  # noqa: E402

from relayrl.judge import Judge, RemoteError, TimeoutPool, WorkerCrashed, math_reward  # noqa: E402
from relayrl.sample import Sample  # noqa: E402

# ---- math_reward ---------------------------------------------------------------------------------------
GSM8K_GOLD = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nAltogether she sold 48+24 = <<48+24=72>>72.\n#### 72"
)

MATH_CASES = [  # (response, gold, correct)
    ("The answer is 18.", "18", 1),
    ("In May she sold 24, so 48 + 24 = 72 clips.", GSM8K_GOLD, 1),
    ("She pays 1,234 dollars in total.", "#### 1,234", 1),
    ("#### 1,234", "1234", 1),
    ("The answer is 1,234,567.", "1234567", 1),
    ("1000", "1,000", 1),
    ("\\boxed{10}", "1,000", 0),
    ("It costs $18.", "18", 1),
    ("18 dollars", "#### 18", 1),
    ("\\boxed{18 \\text{ dollars}}", "$18", 1),
    ("\\boxed{\\$1,234}", "#### 1,234", 1),
    ("The discount is 18%.", "18", 1),  # percent: equals both 18 and 0.18 (math-verify's rule)
    ("The discount is 18%.", "0.18", 1),
    ("\\boxed{18\\%}", "18", 1),
    ("The temperature drops to -3 degrees.", "-3", 1),
    ("The answer is \u22123", "-3", 1),  # unicode minus sign
    ("5-3", "-3", 0),  # a subtraction, not minus three: the last number is 3
    ("That gives 18.0", "18", 1),
    ("\\boxed{18.00}", "18", 1),
    ("18.5", "18", 0),
    ("So 3/4 of the cake.", "0.75", 1),
    ("\\boxed{\\frac{3}{4}}", "3/4", 1),
    ("x = \\dfrac{1}{2}", "0.5", 1),
    ("answer: .5", "1/2", 1),
    ("\\boxed{1/3}", "0.333", 0),
    ("First \\boxed{5}, no wait: \\boxed{7}", "7", 1),  # the last boxed wins
    ("First \\boxed{5}, no wait: \\boxed{7}", "5", 0),
    ("\\boxed{\\frac{1}{\\frac{2}{3}}}", "3/2", 1),  # nested braces
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", 1),  # LaTeX gold
    ("\\boxed{2\\pi}", "2\\pi", 1),
    ("\\boxed{(1, 2)}", "(1,2)", 1),
    ("\\boxed{x = 5}", "5", 1),
    ("\\boxed{72}, and 70 apples are left", "72", 1),  # a boxed answer beats later numbers
    ("I first thought 72, but the total is 70.", "72", 0),  # right number earlier, wrong final one
    ("#### 18\nCheck: 3 + 15 = 18 and 2*9", "18", 1),  # '####' marks the answer
    ("", "72", 0),
    ("%%% }{ \\boxed{ $$ garbage", "72", 0),
    ("I don't know.", "72", 0),
    ("\\boxed{}", "0", 0),  # an empty box is no answer, and there is no number
    ("word " * 50_000 + "so the answer is 42", "42", 1),
    ("\\boxed{" * 3000 + "7", "7", 1),  # unclosed boxes are skipped: falls back to the last number
    ("9" * 5000, "9", 0),
]


@pytest.mark.parametrize(("response", "gold", "correct"), MATH_CASES, ids=range(len(MATH_CASES)))
def test_math_reward_cases(response: str, gold: str, correct: int) -> None:
    out = math_reward(response, {"answer": gold})
    assert out["correct"] == correct, (response[:80], gold)
    assert out["reward"] == correct


@pytest.mark.parametrize(
    ("response", "gold", "reward", "fmt"),
    [
        ("so \\boxed{72}", "72", 1.1, 1.0),
        ("so \\boxed{70}", "72", 0.1, 1.0),
        ("so 72", "72", 1.0, 0.0),
        ("so \\boxed{72", "72", 1.0, 0.0),  # unclosed: no format credit, last number still counts
    ],
)
def test_math_reward_format_bonus(response: str, gold: str, reward: float, fmt: float) -> None:
    out = math_reward(response, {"answer": gold}, format_bonus=0.1)
    assert out["format"] == fmt
    assert out["reward"] == pytest.approx(reward)


def test_math_reward_answer_key_and_bad_gold() -> None:
    assert math_reward("42", {"target": "#### 42"}, answer_key="target")["correct"] == 1.0
    with pytest.raises(ValueError, match="answer"):
        math_reward("42", {})
    with pytest.raises(ValueError, match="answer"):
        math_reward("42", {"answer": "  "})


@pytest.mark.parametrize(
    "response", [None, b"\\boxed{1}", "\x00\uffff\\boxed{\\frac{", "}" * 1000, "\\boxed{\\left(}"]
)
def test_math_reward_never_raises(response: object) -> None:
    assert math_reward(response, {"answer": "1"})["correct"] == 0.0  # type: ignore[arg-type]


def test_math_reward_works_off_the_main_thread() -> None:
    """math-verify's SIGALRM timeouts would raise in a thread; math_reward must switch them off there."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as ex:
        outs = list(ex.map(lambda r: math_reward(r, {"answer": "\\frac{3}{4}"}), ["\\boxed{0.75}", "so 3/4"]))
    assert [o["correct"] for o in outs] == [1.0, 1.0]


def test_math_reward_is_fast() -> None:
    start = time.perf_counter()
    for i in range(200):
        math_reward(f"Step 1: 3 + 4 = 7. The answer is {i}.", {"answer": "#### 7"})
    assert time.perf_counter() - start < bound(2.0)


# ---- TimeoutPool ---------------------------------------------------------------------------------------
def _alive(pid: int) -> bool:
    """Alive and not a zombie (a container's pid 1 may never reap orphans)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


@pytest.fixture(scope="module")
def pool():
    with TimeoutPool(workers=1, preload=["judge_fns"]) as p:
        yield p


def test_pool_result_remote_error_and_kwargs(pool: TimeoutPool) -> None:
    assert pool.run_sync(judge_fns.divide, 1, 4, timeout=10) == 0.25
    assert pool.run_sync("judge_fns:echo", {"a": [1]}, timeout=10) == {"a": [1]}
    with pytest.raises(RemoteError) as info:
        pool.run_sync(judge_fns.divide, 1, 0, timeout=10)
    assert info.value.exc_type == "ZeroDivisionError"
    assert "judge_fns.py" in info.value.remote_traceback and "divide" in info.value.remote_traceback
    assert "timeout" in asyncio.run(pool.call(judge_fns.echo, ({"timeout": 1},), timeout=10))


def test_pool_unpicklable_fn_fails_in_caller(pool: TimeoutPool) -> None:
    with pytest.raises(TypeError, match="cannot send"):
        pool.run_sync(lambda: 1, timeout=10)
    assert pool.run_sync(judge_fns.echo, 3, timeout=10) == 3


def test_pool_timeout_kills_and_replaces_worker(pool: TimeoutPool) -> None:
    old = pool.run_sync(judge_fns.worker_pid, timeout=10)
    start = time.perf_counter()
    with pytest.raises(TimeoutError, match="0.5s"):
        pool.run_sync(judge_fns.sleep_then, 100, "late", timeout=0.5)
    assert time.perf_counter() - start < bound(2.0)
    assert not _alive(old)
    assert pool.run_sync(judge_fns.worker_pid, timeout=30) != old


def test_pool_replaces_worker_killed_while_idle(pool: TimeoutPool) -> None:
    old = pool.run_sync(judge_fns.worker_pid, timeout=30)
    os.kill(old, signal.SIGKILL)
    time.sleep(0.2)
    assert pool.run_sync(judge_fns.echo, "still here", timeout=30) == "still here"


def test_pool_worker_crash_is_reported_and_replaced(pool: TimeoutPool) -> None:
    with pytest.raises(WorkerCrashed, match="exited with code 3 while running _exit"):
        pool.run_sync(os._exit, 3, timeout=10)
    assert pool.run_sync(judge_fns.echo, "replaced", timeout=30) == "replaced"


def test_pool_workers_ignore_sigint(pool: TimeoutPool) -> None:
    assert "SIG_IGN" in pool.run_sync(judge_fns.sigint_handler, timeout=30)


def test_pool_cancelled_call_kills_its_worker(pool: TimeoutPool) -> None:
    old = pool.run_sync(judge_fns.worker_pid, timeout=30)

    async def main() -> None:
        task = asyncio.ensure_future(pool.run(judge_fns.sleep_then, 100, None, timeout=None))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert not _alive(old)
    assert pool.run_sync(judge_fns.echo, "after cancel", timeout=30) == "after cancel"


def test_pool_preload_failure_is_reported() -> None:
    with TimeoutPool(workers=1, preload=["no_such_module_xyz"]) as p, pytest.raises(WorkerCrashed) as info:
        p.run_sync(judge_fns.echo, 1, timeout=10)
    assert "failed to start" in str(info.value) and "no_such_module_xyz" in str(info.value)


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_pool_queues_concurrent_calls_and_close_kills_workers(context: str) -> None:
    async def main(p: TimeoutPool) -> list[int]:
        return await asyncio.gather(*(p.run(judge_fns.sleep_then, 0.05, i, timeout=30) for i in range(12)))

    p = TimeoutPool(workers=2, context=context)
    assert asyncio.run(main(p)) == list(range(12))
    pids = p.worker_pids()
    assert len(pids) == 2
    p.close()
    assert not any(_alive(pid) for pid in pids)
    with pytest.raises(RuntimeError, match="closed"):
        p.run_sync(judge_fns.echo, 1, timeout=1)


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_pool_worker_dies_with_its_parent(context: str) -> None:
    """A SIGKILLed parent runs no cleanup; its worker, even mid-call, must still go away."""
    script = textwrap.dedent(f"""
        import asyncio, sys
        sys.path.insert(0, {TESTS_DIR!r})
        import judge_fns
        from relayrl.judge import TimeoutPool

        async def main():
            pool = TimeoutPool(workers=1, context={context!r})
            print(await pool.run(judge_fns.worker_pid, timeout=60), flush=True)
            await pool.run(judge_fns.sleep_then, 100, None, timeout=None)

        asyncio.run(main())
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(parent.stdout.readline())
        time.sleep(0.3)  # let the hanging call reach the worker
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 5
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker)
    finally:
        parent.kill()


# ---- Judge ---------------------------------------------------------------------------------------------
def _sample(response: str, **data: object) -> Sample:
    return Sample(prompt_ids=[1, 2, 3], data=dict(data), response_text=response)


def _judge_all(judge: Judge, samples: list[Sample]) -> list[Sample]:
    async def main() -> list[Sample]:
        return await asyncio.gather(*(judge.judge(s) for s in samples))

    return asyncio.run(main())


@pytest.fixture(scope="module")
def bad_judge():
    judge = Judge("judge_fns:misbehave", timeout=1.0, workers=2, max_abs_reward=100.0)
    judge.start()
    yield judge
    judge.close()


def test_judge_merges_returned_metrics(bad_judge: Judge) -> None:
    s = _judge_all(bad_judge, [_sample("abc", mode="ok")])[0]
    assert s.reward == 0.5
    assert s.metrics == {"reward": 0.5, "correct": 1.0, "n_chars": 3.0, "judge_failed": 0.0}
    assert s.error is None


@pytest.mark.parametrize(
    ("mode", "code", "reason"),
    [
        ("raise", "error", "raised ZeroDivisionError: boom second line"),
        ("exit", "crashed", "exited with code 1"),
        ("segfault", "crashed", "killed by SIGSEGV"),
        ("string", "invalid", "invalid reward: '1.0'"),
        ("nan", "nonfinite", "nonfinite reward: nan"),
        ("inf", "nonfinite", "nonfinite reward: -inf"),
        ("huge", "out_of_range", "out-of-range reward: 1e+30"),
        ("no_reward_key", "invalid", "without 'reward'"),
    ],
)
def test_judge_failure_is_rejected_with_its_reason(bad_judge: Judge, mode: str, code: str, reason: str) -> None:
    calls, failures = bad_judge.calls, bad_judge.failures
    s = _judge_all(bad_judge, [_sample("x", mode=mode)])[0]
    assert s.reward == 0.0
    assert s.metrics == {"reward": 0.0, "judge_failed": 1.0, f"judge_rejected_{code}": 1.0}
    assert reason in s.error and "\n" not in s.error
    assert (bad_judge.calls, bad_judge.failures) == (calls + 1, failures + 1)
    assert _judge_all(bad_judge, [_sample("abcd", mode="ok")])[0].reward == 0.5  # the pool still works


def test_judge_hang_times_out_and_pool_recovers(bad_judge: Judge) -> None:
    _judge_all(bad_judge, [_sample("", mode="ok"), _sample("", mode="ok")])  # both workers warm
    failures = bad_judge.failures
    start = time.perf_counter()
    s = _judge_all(bad_judge, [_sample("x", mode="hang")])[0]
    assert time.perf_counter() - start < bound(3.0)
    assert s.reward == 0.0 and s.metrics["judge_failed"] == 1.0
    assert "timed out after 1s" in s.error
    assert bad_judge.failures == failures + 1
    assert _judge_all(bad_judge, [_sample("abc", mode="ok")])[0].metrics["judge_failed"] == 0.0


def test_judge_hangs_mixed_with_good_calls(bad_judge: Judge) -> None:
    """Two hung calls must cost about one timeout each on their worker, not stall the others."""
    samples = [_sample("x" * i, mode="hang" if i in (3, 7) else "ok") for i in range(20)]
    start = time.perf_counter()
    out = _judge_all(bad_judge, samples)
    assert time.perf_counter() - start < bound(8.0)
    assert [s.metrics["judge_failed"] for s in out] == [1.0 if i in (3, 7) else 0.0 for i in range(20)]
    assert all(s.metrics["n_chars"] == i for i, s in enumerate(out) if i not in (3, 7))


def test_judge_many_concurrent_math_samples() -> None:
    samples = []
    for i in range(64):
        gold = f"#### {i * 1000:,}"
        answer = i * 1000 if i % 3 else i * 1000 + 1
        samples.append(_sample(f"Reasoning... so the total is \\boxed{{{answer:,}}}.", answer=gold))
    runaway = _sample("\\boxed{10^{10^{10}}}", answer="1")  # sympy would evaluate this for ages
    with Judge(reward_kwargs={"format_bonus": 0.1}, workers=2) as judge:
        out = _judge_all(judge, [*samples, runaway])
        assert judge.calls == 65 and judge.failures <= 1
    assert out.pop().metrics.get("correct", 0.0) == 0.0  # math-verify's own timeout, or else the pool's
    for i, s in enumerate(out):
        expected = 1.0 if i % 3 else 0.0
        assert s.metrics["correct"] == expected, (i, s.response_text, s.data)
        assert s.metrics["format"] == 1.0 and s.reward == pytest.approx(expected + 0.1)
        assert s.metrics["judge_failed"] == 0.0


def test_judge_accepts_importable_callable_and_kwargs() -> None:
    with Judge(judge_fns.length_reward, reward_kwargs={"scale": 2.0}, workers=1) as judge:
        assert judge.reward_path == "judge_fns:length_reward"
        assert _judge_all(judge, [_sample("abc")])[0].reward == 6.0


def test_judge_rejects_bad_reward_fn_at_construction() -> None:
    with pytest.raises(ImportError, match="no_such_module_xyz:fn"):
        Judge("no_such_module_xyz:fn")
    with pytest.raises(ImportError, match="judge_fns:no_such_fn"):
        Judge("judge_fns:no_such_fn")
    with pytest.raises(TypeError, match="judge_fns:NOT_CALLABLE"):
        Judge("judge_fns:NOT_CALLABLE")
    with pytest.raises(ValueError, match="not importable by path"):
        Judge(lambda response, data: 1.0)

    def local_reward(response: str, data: dict) -> float:
        return 1.0

    with pytest.raises(ValueError, match="not importable by path"):
        Judge(local_reward)
    with pytest.raises(TypeError, match="picklable"):
        Judge("judge_fns:length_reward", reward_kwargs={"scale": lambda: 1})


def test_memory_limit_costs_the_sample_and_replaces_the_worker() -> None:
    """judge.memory_mb: a reward that allocates past the cap is rejected ("memory"), its worker is replaced,
    and the next sample is scored normally."""
    with Judge("judge_fns:misbehave", workers=1, memory_mb=512) as judge:
        assert _judge_all(judge, [_sample("ab", mode="ok")])[0].reward == 0.5
        before = judge.pool.worker_pids()
        s = _judge_all(judge, [_sample("x", mode="allocate")])[0]
        assert s.metrics["judge_rejected_memory"] == 1.0 and "judge.memory_mb=512" in s.error
        assert judge.pool.worker_pids() != before  # replaced at once, not reused
        assert _judge_all(judge, [_sample("abc", mode="ok")])[0].reward == 0.5
    with Judge("judge_fns:misbehave", workers=1) as unlimited:  # the default (0 here): no cap, it allocates
        assert _judge_all(unlimited, [_sample("x", mode="allocate")])[0].reward == 2**30
    with Judge("judge_fns:misbehave", workers=1, memory_mb=64) as starved:  # below what the loaded worker maps
        starved.start()
        with pytest.raises(WorkerCrashed, match=r"(?s)already maps \d+ MiB.*judge.memory_mb=64 MiB"):
            starved.wait_ready()


def test_reward_kwargs_are_checked_against_the_signature() -> None:
    from relayrl.judge import reward_kwargs_problem

    with pytest.raises(TypeError, match=r"reward_kwargs\['scal'\]: unknown argument for reward function "
                                        r"length_reward; its keyword arguments are scale"):
        Judge("judge_fns:length_reward", reward_kwargs={"scal": 2.0})
    assert reward_kwargs_problem(judge_fns.misbehave, {"x": 1})[0] == "x"  # takes no keyword arguments
    assert reward_kwargs_problem(judge_fns.any_kwargs_reward, {"anything": 1}) is None  # **kwargs takes all
    assert reward_kwargs_problem(judge_fns.needs_target, {}) == (
        "target", "reward function needs_target requires argument 'target': set it in judge.kwargs")
    assert reward_kwargs_problem(judge_fns.needs_target, {"target": 3}) is None
    assert reward_kwargs_problem(judge_fns.echo, {})[0] == ""  # cannot take (response, data)


def test_the_tests_reward_module_imports_without_torch():
    """Judge workers import the reward's module before they report ready; tiny runs name rewards_for_tests so
    that takes milliseconds. A torch (or relayrl) import there would add ~4 s to every tiny run's build."""
    code = "import sys, rewards_for_tests; print(sorted(m for m in ('torch', 'relayrl') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": TESTS_DIR},
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", out
