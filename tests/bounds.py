"""Time bounds for tests that wait on subprocesses, servers and clusters: a hang still fails, a busy machine does not.

Why: a fixed bound says how long a run takes on an idle machine. The suite runs four files at a time on two cores,
CI may share its machine, and a developer's machine may be running a benchmark: then the same run takes two to
five times as long, and a fixed 240 s bound failed a Ray test that was progressing fine. Two tools here:
- `bound(seconds)`: the idle-machine figure scaled by how loaded the machine is now (the 1-minute load average
  per core, at least 1) and by RELAYRL_TEST_SLACK (default 1; a slow machine sets 2 or 3). tests/conftest.py
  scales pytest-timeout's per-test limit the same way.
- `run_progressing(cmd, idle=...)`: a subprocess that fails when it prints nothing for `bound(idle)` seconds (a
  hang), or runs past `bound(cap)` (a livelock that keeps printing), whatever the load.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time


def load_factor() -> float:
    """How many times slower than idle the machine runs now: the 1-minute load per core, at least 1."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # no load average on this platform
        return 1.0
    return max(1.0, load / (os.cpu_count() or 1))


def bound(seconds: float) -> float:
    """`seconds` (what the wait takes on an idle machine, with margin) scaled to the machine's load now."""
    return seconds * load_factor() * float(os.environ.get("RELAYRL_TEST_SLACK", "1"))


def run_progressing(cmd: list[str], *, idle: float = 180.0, cap: float = 1800.0,
                    **popen) -> subprocess.CompletedProcess:
    """Run `cmd` to the end, capturing text output; raise subprocess.TimeoutExpired (with the output so far) when
    it prints nothing on stdout or stderr for bound(idle) seconds or runs longer than bound(cap)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
    out: dict[str, list[str]] = {"stdout": [], "stderr": []}
    last = [time.monotonic()]

    def pump(stream, into: list[str]) -> None:
        for line in stream:
            into.append(line)
            last[0] = time.monotonic()

    readers = [threading.Thread(target=pump, args=(s, out[k]), daemon=True)
               for k, s in (("stdout", proc.stdout), ("stderr", proc.stderr))]
    for r in readers:
        r.start()
    start = time.monotonic()
    while proc.poll() is None:
        now = time.monotonic()
        if now - last[0] > bound(idle) or now - start > bound(cap):
            proc.kill()
            proc.wait()
            why = "printed nothing for" if now - last[0] > bound(idle) else "ran past"
            raise subprocess.TimeoutExpired(cmd, round(now - start), output="".join(out["stdout"]),
                                            stderr="".join(out["stderr"]) + f"\n[{why} its bound]")
        time.sleep(0.2)
    for r in readers:
        r.join(10)
    return subprocess.CompletedProcess(cmd, proc.returncode, "".join(out["stdout"]), "".join(out["stderr"]))
