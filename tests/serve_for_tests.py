"""A `relayrl serve` subprocess for tests: started with the CLI, ready once its ready line is printed, stopped
with SIGTERM (a graceful shutdown exits with 0)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

from bounds import bound

ROOT = Path(__file__).resolve().parents[1]
READY = re.compile(r"relayrl serve: ready on (http://\S+)")


class Server:
    """A `relayrl serve` subprocess; `url` is known once its ready line was read."""

    def __init__(self, model: str, log: Path, *extra: str):
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        cmd = [sys.executable, "-m", "relayrl.cli", "serve", "--model", model, "--dtype", "float32", "--port", "0",
               "--log-level", "warning", *extra]
        self.log = log
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log.open("w"),
                                     text=True)
        self.url: str | None = None
        self.lines: list[str] = []  # stdout up to the ready line

    def wait_ready(self, timeout: float = 90.0) -> str:
        """Read stdout (in a thread, so the timeout holds) until the ready line."""
        def read() -> None:
            for line in self.proc.stdout:
                self.lines.append(line)
                m = READY.search(line)
                if m:
                    self.url = m.group(1)
                    return

        if self.url is None:
            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            reader.join(bound(timeout))
        assert self.url, f"server not ready after {bound(timeout):.0f}s; stderr:\n{self.log.read_text()[-3000:]}"
        return self.url

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM and wait: a graceful shutdown exits with 0 in a few seconds."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
