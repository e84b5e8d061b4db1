"""Shared by the sandbox tests: skip (with the reason) only where no sandbox can start, and host-side checks."""

import asyncio
import os
import socket
import threading

import pytest

from relayrl.tools import SandboxUnavailable, run_python
from relayrl.tools.bwrap import ready


def _unavailable() -> str | None:
    try:
        ready()
    except SandboxUnavailable as e:
        return str(e)
    return None


UNAVAILABLE = _unavailable()
needs_sandbox = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no OS sandbox can start here: {UNAVAILABLE}")


def run(code: str, **kw):
    return asyncio.run(run_python(code, **kw))


def host_processes_with(marker: str) -> list[str]:
    """Command lines of host processes containing `marker` (what `ps -eo args | grep` shows)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in args and pid != str(os.getpid()):
            found.append(args)
    return found


class Listener:
    """A real TCP listener on the host's 127.0.0.1 that records every connection and every byte it gets."""

    def __init__(self, family: int = socket.AF_INET, address=("127.0.0.1", 0)):
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.bind(address)
        self.sock.listen()
        self.sock.settimeout(0.2)
        self.got: list[bytes] = []
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    def _serve(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            conn.settimeout(1)
            try:
                self.got.append(b"<connected>" + conn.recv(1024))
            except OSError:
                self.got.append(b"<connected>")
            conn.close()

    def close(self) -> list[bytes]:
        self._stop = True
        self._thread.join(2)
        self.sock.close()
        return self.got
