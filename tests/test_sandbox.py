"""The Python sandbox with real subprocesses: runaway code is contained and reported, never a hang or a leak."""

import asyncio
import socket
import threading
import time

import pytest

from relayrl.tools import calculator_tool, evaluate, python_tool, run_python


def run(code, **kw):
    return asyncio.run(run_python(code, **kw))


def test_prints_and_exit_code():
    r = run("print(6 * 7)")
    assert r.ok and r.stdout == "42\n" and r.text() == "42"
    r = run("import sys; print('partial'); sys.exit(3)")
    assert r.exit_code == 3 and not r.ok


def test_infinite_loop_is_killed_at_the_timeout():
    t0 = time.perf_counter()
    r = run("while True:\n    pass", timeout=1.0)
    assert r.timed_out and r.exit_code is None and "timed out" in r.text()
    assert time.perf_counter() - t0 < 4


def test_sleeping_child_cannot_outlive_the_timeout():
    r = run("import time\ntime.sleep(60)", timeout=0.5)
    assert r.timed_out and r.duration_s < 3


@pytest.mark.parametrize("code", ["x = bytearray(4 * 1024 ** 3)",
                                  "chunks = []\nwhile True:\n    chunks.append(bytearray(50 * 1024 ** 2))"])
def test_memory_bomb_is_contained(code):
    r = run(code, memory_mb=256, timeout=20)
    assert not r.ok and not r.timed_out
    assert "MemoryError" in r.stderr


def test_network_is_refused():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(3)
    port = server.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(_accept(server)), daemon=True).start()
    r = run(f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')")
    assert not r.ok and "connected" not in r.stdout
    assert "sandbox" in r.stderr or "unreachable" in r.stderr.lower()
    time.sleep(0.2)
    assert accepted in ([], [None])
    r = run("import urllib.request\nurllib.request.urlopen('http://example.com', timeout=2)")
    assert not r.ok
    server.close()


def _accept(server):
    try:
        return server.accept()
    except OSError:
        return None


def test_writes_outside_the_working_directory_are_refused(tmp_path):
    outside = tmp_path / "escape.txt"
    victim = tmp_path / "keep.txt"
    victim.write_text("important")
    r = run(f"open({str(outside)!r}, 'w').write('pwned')")
    assert not r.ok and "outside the working directory" in r.stderr and not outside.exists()
    r = run(f"import os\nos.remove({str(victim)!r})")
    assert not r.ok and victim.read_text() == "important"
    r = run("import pathlib\npathlib.Path('scratch.txt').write_text('ok')\nprint(open('scratch.txt').read())")
    assert r.ok and r.stdout.strip() == "ok"  # its own scratch folder is writable


@pytest.mark.parametrize("code", ["import subprocess; subprocess.run(['echo', 'hi'])", "import os; os.system('ls')",
                                  "import os; os.fork()", "import ctypes; ctypes.CDLL(None)",
                                  "import resource; resource.setrlimit(resource.RLIMIT_AS, (-1, -1))"])
def test_processes_native_code_and_limits_are_refused(code):
    r = run(code)
    assert not r.ok and "sandbox" in r.stderr


def test_output_is_truncated():
    r = run("print('x' * 10000)", max_output=100)
    assert r.truncated and len(r.stdout) == 100 and r.text().endswith("[output truncated]")


def test_concurrent_runs():
    async def many():
        return await asyncio.gather(*(run_python(f"print({i} * {i})") for i in range(6)))

    assert [r.stdout.strip() for r in asyncio.run(many())] == [str(i * i) for i in range(6)]


@pytest.mark.parametrize("expr, want", [("2 + 3 * 4", "14"), ("(12 + 7) * 3 / 2", "28.5"), ("2^10", "1024"),
                                        ("1,234 + 1", "1235"), ("-3 - -4", "1"), ("sqrt(16)", "4"),
                                        ("10 // 3", "3"), ("1 / 0", "error: division by zero"),
                                        ("__import__('os').system('ls')", "error: unsupported expression"),
                                        ("9 ** 9 ** 9", "error: exponent too large"), ("2 +", "error: invalid")])
def test_calculator(expr, want):
    assert evaluate(expr).startswith(want)


def test_tool_schemas_and_calls():
    calc, py = calculator_tool(), python_tool(timeout=2)
    assert calc.schema()["function"]["name"] == "calculator"
    assert py.schema()["function"]["parameters"]["required"] == ["code"]
    assert asyncio.run(calc({"expression": "6*7"})) == "42"
    assert asyncio.run(py({"code": "print(sum(range(10)))"})) == "45"
