"""Inference servers that a run starts, waits for, and always stops: `relayrl serve` or a vLLM server.

A `ManagedServer` is a subprocess in its own process group with its output in a log file. It is ready when
GET /health answers 200; if it exits or stays unhealthy past the timeout, the error quotes the log's tail, so a
bad model path or an import error in the server's virtualenv is shown, not a bare timeout. It is stopped by
`stop()`, at interpreter exit, and -- on Linux -- by the kernel when the launching process dies (even of
SIGKILL), so no server outlives its run.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from relayrl.common.net import free_port, is_loopback

_LIVE: set[ManagedServer] = set()


def _die_with_parent() -> None:  # runs in the child between fork and exec
    os.setsid()
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class ManagedServer:
    """One server subprocess; see the module docstring."""

    def __init__(self, cmd: list[str], port: int, log_path: Path, *, host: str = "127.0.0.1",
                 env: dict[str, str] | None = None, name: str = "server"):
        self.cmd, self.port, self.host, self.name = cmd, port, host, name
        self.log_path = Path(log_path)
        self.url = f"http://{host}:{port}"
        self._env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self) -> ManagedServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            preexec = _die_with_parent if sys.platform.startswith("linux") else os.setsid
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self._env, preexec_fn=preexec)
        _LIVE.add(self)
        return self

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_ready(self, timeout: float = 300.0, interval: float = 0.25) -> ManagedServer:
        """Poll GET /health; fail with the log's tail if the process exits or the timeout passes."""
        deadline = time.monotonic() + timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(f"{self.name} ({' '.join(self.cmd[:4])} ...) exited with code {code} before it "
                                   f"was ready; log {self.log_path}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return self
            if time.monotonic() >= deadline:
                self.stop()
                raise TimeoutError(f"{self.name} at {self.url} not healthy after {timeout:.0f}s; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            time.sleep(interval)

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM the process group, SIGKILL it if still there after `timeout`; returns the exit code."""
        _LIVE.discard(self)
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        _signal_group(self.proc.pid, signal.SIGKILL)  # helpers the server left in its group
        return self.proc.returncode


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop(timeout=5.0)


def make_server(e, model: str, log_path: Path, *, seed: int, host: str = "127.0.0.1",
                weights_root: str | Path | None = None) -> ManagedServer:
    """The server `engine.launch` asks for (`e` is the run's EngineConfig), not started yet. `weights_root` is
    the folder the run writes new weights to (engine.weights_dir); a relayrl server loads weights from under
    it only, and only when they travel by disk (engine.weight_sync=disk)."""
    if e.launch == "relayrl":
        return relayrl_server(model, log_path, dtype=e.dtype, max_batch_size=e.max_batch_size,
                              max_seq_len=e.max_seq_len, max_tokens_in_flight=e.max_tokens_in_flight,
                              api_key=e.api_key, seed=seed, host=host,
                              weights_root=weights_root if e.weight_sync == "disk" else None)
    return vllm_server(e.vllm_python, model, log_path, dtype=e.dtype, max_model_len=e.max_seq_len,
                       api_key=e.api_key, seed=seed, host=host)


def relayrl_server(model: str, log_path: Path, *, dtype: str = "bfloat16", max_batch_size: int = 64,
                   max_seq_len: int | None = None, max_tokens_in_flight: int | None = None,
                   api_key: str | None = None, seed: int = 0, host: str = "127.0.0.1",
                   weights_root: str | Path | None = None) -> ManagedServer:
    """`relayrl serve` with this interpreter (so it runs the same relayrl as the trainer). `weights_root`
    (created here) enables /update_weights_from_disk for folders under it. A non-loopback host without an
    API key is passed --insecure, as launched servers always listened so; set engine.api_key to close it."""
    port = free_port(host)
    # no --log-level: the server logs at the run's level, RELAYRL_LOG_LEVEL (inherited)
    cmd = [sys.executable, "-m", "relayrl.cli", "serve", "--model", model, "--host", host, "--port", str(port),
           "--dtype", dtype, "--max-batch-size", str(max_batch_size), "--seed", str(seed)]
    if max_seq_len:
        cmd += ["--max-seq-len", str(max_seq_len)]
    if max_tokens_in_flight:
        cmd += ["--max-tokens-in-flight", str(max_tokens_in_flight)]
    if api_key:
        cmd += ["--api-key", api_key]
    elif not is_loopback(host):
        logging.getLogger(__name__).warning("relayrl serve on %s without an API key: anyone who can reach it can "
                                            "use it (set engine.api_key)", host)
        cmd += ["--insecure"]
    if weights_root is not None:
        Path(weights_root).mkdir(parents=True, exist_ok=True)
        cmd += ["--weights-root", str(weights_root)]
    return ManagedServer(cmd, port, log_path, host=host, name="relayrl serve")


def vllm_server(python: str, model: str, log_path: Path, *, dtype: str = "bfloat16",
                max_model_len: int | None = None, api_key: str | None = None, seed: int = 0,
                host: str = "127.0.0.1") -> ManagedServer:
    """vLLM's OpenAI server run by the interpreter of its own virtualenv (vLLM pins its own torch and
    transformers, so it cannot share relayrl's environment)."""
    if not Path(python).exists():
        raise FileNotFoundError(f"engine.vllm_python: {python} does not exist (create it with scripts/setup_vllm.sh)")
    port = free_port(host)
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", host,
           "--port", str(port), "--dtype", dtype, "--seed", str(seed), "--enforce-eager"]
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    if api_key:
        cmd += ["--api-key", api_key]
    return ManagedServer(cmd, port, log_path, host=host, name="vllm server",
                         env={"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2",
                              "VLLM_SERVER_DEV_MODE": "1"})  # dev routes: weight reloads, pause, resume
