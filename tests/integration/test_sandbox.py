"""The Python sandbox with real bwrap sandboxes: runaway code is contained and reported, never a hang or a leak;
the sandbox setting refuses at start-up where no sandbox can start; the calculator is bounded.
Escape attempts are in test_sandbox_escapes.py."""

import asyncio
import os
import subprocess
import time
from pathlib import Path

import pytest
from bounds import bound
from sandbox_helpers import host_processes_with, needs_sandbox, run

from relayrl.agents.tool import ToolAgent
from relayrl.tools import SandboxUnavailable, calculator_tool, check_sandbox, evaluate, python_tool, run_python
from relayrl.tools.bwrap import ENV_BINARY, NOBODY, ready


@needs_sandbox
def test_prints_and_exit_code():
    r = run("print(6 * 7)")
    assert r.ok and r.stdout == "42\n" and r.text() == "42" and r.network == "bwrap"
    r = run("import sys; print('partial'); sys.exit(3)")
    assert r.exit_code == 3 and not r.ok
    assert run("print('caf\udce9')").stdout == "caf?\n"  # a lone surrogate from JSON is not a crash
    r = run("raise ValueError('bad input')")
    assert r.exit_code == 1 and r.text() == "ValueError: bad input" and 'File "main.py", line 1' in r.stderr


@needs_sandbox
def test_scratch_is_the_writable_working_directory():
    r = run("import os, pathlib\npathlib.Path('scratch.txt').write_text('ok')\nprint(open('scratch.txt').read(), "
            "os.getcwd(), os.environ['HOME'], sorted(os.listdir('.')))")
    assert r.ok and r.stdout.split() == ["ok", "/scratch", "/scratch", "['main.py',", "'scratch.txt']"]


@needs_sandbox
def test_infinite_loop_is_killed_at_the_timeout():
    t0 = time.perf_counter()
    r = run("while True:\n    pass", timeout=1.0)
    assert r.timed_out and r.exit_code is None and "timed out" in r.text()
    assert time.perf_counter() - t0 < bound(4)


@needs_sandbox
def test_sleeping_child_cannot_outlive_the_timeout():
    r = run("import time\ntime.sleep(60)", timeout=0.5)
    assert r.timed_out and r.duration_s < bound(3)


@needs_sandbox
@pytest.mark.parametrize("code", ["x = bytearray(4 * 1024 ** 3)",
                                  "chunks = []\nwhile True:\n    chunks.append(bytearray(50 * 1024 ** 2))"])
def test_memory_bomb_is_contained(code):
    r = run(code, memory_mb=256, timeout=20)
    assert not r.ok and not r.timed_out
    assert "MemoryError" in r.stderr


@needs_sandbox
def test_output_is_truncated():
    r = run("print('x' * 10000)", max_output=100)
    assert r.truncated and len(r.stdout) == 100 and r.text().endswith("[output truncated]")


@needs_sandbox
def test_concurrent_runs():
    async def many():
        return await asyncio.gather(*(run_python(f"print({i} * {i})") for i in range(6)))

    assert [r.stdout.strip() for r in asyncio.run(many())] == [str(i * i) for i in range(6)]


@needs_sandbox
def test_cancelled_call_kills_the_sandbox():
    """The agent's own tool_timeout cancels run_python: the sandbox must die with the cancellation."""
    marker = f"relayrl-cancel-{os.getpid()}"

    async def cancelled():
        code = f"import os, sys\nos.execv(sys.executable, [sys.executable, '-c', 'while True: pass', '{marker}'])"
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(run_python(code, timeout=30), 0.5)

    asyncio.run(cancelled())
    assert host_processes_with(marker) == []


@needs_sandbox
def test_tool_schemas_and_calls():
    calc, py = calculator_tool(), python_tool(timeout=2)
    assert calc.schema()["function"]["name"] == "calculator"
    assert py.schema()["function"]["parameters"]["required"] == ["code"]
    assert asyncio.run(calc({"expression": "6*7"})) == "42"
    assert asyncio.run(py({"code": "print(sum(range(10)))"})) == "45"


@needs_sandbox
def test_sandbox_starts_as_an_unprivileged_user():
    """As root relayrl starts bwrap as uid 65534; run the whole of run_python as that user too, as a non-root
    trainer would (the same kernel path: unprivileged user namespaces)."""
    if os.geteuid() != 0 or not Path("/usr/bin/setpriv").exists():
        pytest.skip("needs root and setpriv to switch to an unprivileged user (as non-root, every test is this)")
    box, repo = ready(), Path(__file__).resolve().parents[2]
    code = ("import asyncio; from relayrl.tools.sandbox import run_python; "
            "r = asyncio.run(run_python('import os; print(os.getuid(), os.getpid())')); print(r.stdout, r.stderr)")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(repo), ENV_BINARY: box.binary}
    r = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", box.interpreter,
                        "-c", code], env=env, capture_output=True, text=True, timeout=60, cwd="/")
    if "Permission denied" in r.stderr or "No module named" in r.stderr:
        pytest.skip(f"uid {NOBODY} cannot read this checkout: {r.stderr.strip()[-200:]}")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[:2] == [str(NOBODY), "2"]  # pid 2 of its own pid namespace


def test_auto_and_bwrap_refuse_at_start_up_without_bwrap(monkeypatch):
    monkeypatch.setenv(ENV_BINARY, "/nonexistent/bwrap")
    for mode in ("auto", "bwrap"):
        with pytest.raises(SandboxUnavailable, match="RELAYRL_BWRAP=/nonexistent/bwrap does not exist.*sandbox: none"):
            python_tool(sandbox=mode)
    with pytest.raises(SandboxUnavailable):  # agent construction, before any model call
        ToolAgent(None, None, None, tools=["python", "calculator"])
    with pytest.raises(SandboxUnavailable):
        run("print(1)")


def test_bwrap_that_cannot_start_is_refused(tmp_path, monkeypatch):
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)  # (as root, uid 65534 cannot even reach it: pytest's tmp folders are 0700; refused too)
    monkeypatch.setenv(ENV_BINARY, str(fake))
    with pytest.raises(SandboxUnavailable, match="bwrap cannot start a sandbox here"):
        check_sandbox("auto")


def test_none_runs_unsandboxed_with_a_loud_warning(monkeypatch):
    monkeypatch.setenv(ENV_BINARY, "/nonexistent/bwrap")  # none never needs bwrap
    with pytest.warns(RuntimeWarning, match="UNSANDBOXED"):
        py = python_tool(timeout=5, sandbox="none")
    assert asyncio.run(py({"code": "print(sum(range(10)))"})) == "45"
    r = run("import os; print(os.getpid() > 2)", sandbox="none")
    assert r.ok and r.stdout == "True\n" and r.network == "none"
    r = run("while True:\n    pass", timeout=0.5, sandbox="none")
    assert r.timed_out


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="sandbox must be one of"):
        python_tool(sandbox="docker")


@pytest.mark.parametrize("expr, want", [("2 + 3 * 4", "14"), ("(12 + 7) * 3 / 2", "28.5"), ("2^10", "1024"),
                                        ("1,234 + 1", "1235"), ("-3 - -4", "1"), ("sqrt(16)", "4"),
                                        ("10 // 3", "3"), ("1 / 0", "error: division by zero"),
                                        ("2 ** 100", str(2 ** 100)), ("(-2) ** 3", "-8"), ("2 ** -2", "0.25"),
                                        ("__import__('os').system('ls')", "error: unsupported expression"),
                                        ("9 ** 9 ** 9", "error: exponent too large"), ("2 +", "error: invalid")])
def test_calculator(expr, want):
    assert evaluate(expr).startswith(want)


@pytest.mark.parametrize("expr", [
    "9**9**9", "2**10**10", "10**100000", "(10**5000)**2", "2**(2**64)", "7**7**7**7",
    "*".join(["99999999999"] * 800),  # a factorial-like product within the length limit
    "(10**3000)*(10**3000)", "*".join(["(10**2000)"] * 10),
    "(" * 5000 + "1" + ")" * 5000, "-" * 5000 + "1", "1" + "+1" * 4900, "2**" * 3000 + "2",
    "1" * 20000, "exp(10**4)", "sqrt(10**3000)", "2.0 ** (10**400)",
])
def test_calculator_refuses_pathological_expressions_fast(expr):
    t0 = time.perf_counter()
    result = evaluate(expr)
    assert result.startswith("error:"), result[:80]
    assert time.perf_counter() - t0 < bound(1.0)


def test_calculator_tool_never_raises_and_never_blocks_the_loop():
    calc = calculator_tool()

    async def both():
        ticks = []

        async def ticker():
            for _ in range(5):
                ticks.append(time.perf_counter())
                await asyncio.sleep(0.01)

        results = await asyncio.gather(calc({"expression": "9**9**9**9"}), calc({"expression": "2**10**10"}),
                                       ticker())
        return results[:2], ticks

    t0 = time.perf_counter()
    (a, b), ticks = asyncio.run(both())
    assert a.startswith("error") and b.startswith("error") and time.perf_counter() - t0 < bound(1.0)
    assert len(ticks) == 5

