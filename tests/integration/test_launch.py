"""`relayrl train` starts a run's processes in one place (relayrl.run.launch): Ray, torchrun or this process. The
in-process and Ray paths are driven through the CLI by tests/integration/test_async.py and test_ray.py, and torchrun's
training by test_fsdp_loop.py; here, stopping a torchrun launch: SIGTERM reaches only the `relayrl` process, which
passes it to torchrun, so the ranks stop and the command ends as a terminated run does."""

import os
import signal
import subprocess
import sys
import time

from bounds import bound
from conftest import TESTS, tiny_run_args, write_sums


def _processes_with(marker: str, command: str = "") -> list[int]:
    """The processes whose environment holds `marker` (and whose command line holds `command`)."""
    found = []
    for d in os.scandir("/proc"):
        if d.name.isdigit():
            try:
                with open(f"/proc/{d.name}/environ", "rb") as env, open(f"/proc/{d.name}/cmdline", "rb") as cmd:
                    if marker.encode() in env.read() and command.encode() in cmd.read():
                        found.append(int(d.name))
            except OSError:
                pass
    return found


def test_sigterm_stops_a_torchrun_launch_and_its_ranks(tiny_path, tmp_path):
    marker = f"relayrl-test-{os.getpid()}-{time.time_ns()}"
    data = write_sums(tmp_path / "sums.jsonl", 40)
    args = tiny_run_args(tiny_path, data, tmp_path, **{"train.engine": "fsdp", "train.world_size": 2,
                                                       "run.steps": 10_000})
    env = {**os.environ, "PYTHONPATH": TESTS, "OMP_NUM_THREADS": "1", "RELAYRL_TEST_MARKER": marker}
    proc = subprocess.Popen([sys.executable, "-m", "relayrl.cli", "train", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # SIGTERM to it alone
    try:
        deadline = time.monotonic() + bound(60)
        while len(_processes_with(marker, "relayrl.cli")) < 4 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)  # this command, torchrun, and its two ranks of this command
        assert len(_processes_with(marker, "relayrl.cli")) == 4, "torchrun never started the ranks"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=bound(60))
        assert proc.returncode == 143 and "terminated (SIGTERM)" in out, out[-3000:]
        time.sleep(0.5)
        assert _processes_with(marker) == [], "trainer ranks outlived the run"
    finally:
        if proc.poll() is None:  # a failed check: nothing of the run may outlive the test
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
