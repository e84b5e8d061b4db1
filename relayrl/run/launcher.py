"""Inference servers that a run starts, waits for, and always stops: `relayrl serve`, vLLM's or SGLang's server.

A `ManagedServer` is a subprocess in its own process group with its output in a log file. It is ready when
GET /health answers 200; if it exits or stays unhealthy past the timeout, the error quotes the log's tail, so a
bad model path or an import error in the server's virtualenv is shown, not a bare timeout. Once ready, a watcher
thread waits on it: a server that dies while the run uses it is reported at once (an ERROR naming it, its exit
and its log's tail), before the run's requests to it fail with its address. It is stopped by `stop()`, at
interpreter exit, and -- on Linux -- by the kernel when the launching process dies (even of SIGKILL), so no
server outlives its run.

Command lines: relayrl sets the model, address, API key, dtype, seed and length limits itself
(relayrl.config.engine.SERVER_FLAGS) and appends engine.server_args as written. `check_launch` tries those
arguments on the server's own parser before any model loads: relayrl serve's (imported), vLLM's (in the
interpreter of engine.vllm_python, when it exists); SGLang's cannot be imported here (it installs only where CUDA
is), so its arguments pass through unchecked beyond the flags relayrl sets.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import functools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from relayrl.common.net import free_port, is_loopback
from relayrl.config import ConfigError
from relayrl.config.engine import SERVER_FLAGS, EngineConfig, reserved_flag_problem
from relayrl.serve.args import KEY_ENV, serve_parser

log = logging.getLogger(__name__)
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
        self.death: str | None = None  # set (and logged) when the server dies while the run still uses it
        self._stopping = False

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
                    threading.Thread(target=self._watch, daemon=True, name=f"relayrl-watch-{self.port}").start()
                    return self
            if time.monotonic() >= deadline:
                self.stop()
                raise TimeoutError(f"{self.name} at {self.url} not healthy after {timeout:.0f}s; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            time.sleep(interval)

    def _watch(self) -> None:
        """Wait for the process; its exit before `stop()` is a death the user must hear of with its cause. The
        run's requests to it then fail naming only its address, after their retries."""
        code = self.proc.wait()
        if self._stopping:
            return
        self.death = (f"{self.name} at {self.url} (pid {self.proc.pid}) {_exit(code)} while the run was using it; "
                      f"the end of its log {self.log_path}:\n{self.log_tail(2000)}")
        log.error("%s", self.death)

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM the process group, SIGKILL it if still there after `timeout`; returns the exit code."""
        self._stopping = True
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


def _exit(code: int) -> str:
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop(timeout=5.0)


def make_server(e: EngineConfig, model: str, log_path: Path, *, seed: int, host: str = "127.0.0.1",
                weights_root: str | Path | None = None, lora_rank: int = 0) -> ManagedServer:
    """The server `engine.launch` asks for, with engine.server_args appended, not started yet. `weights_root` is
    the folder the run writes new weights to (engine.weights_dir); a relayrl server loads weights from under
    it only, and only when they travel by disk (engine.weight_sync=disk). `lora_rank` > 0: the run trains LoRA
    adapters; a vLLM server is started ready to load them at run time (relayrl serve merges them itself)."""
    extra = e.launch_args
    if e.launch == "relayrl":
        return relayrl_server(model, log_path, dtype=e.dtype, max_batch_size=e.max_batch_size,
                              max_seq_len=e.max_seq_len, max_tokens_in_flight=e.max_tokens_in_flight,
                              api_key=e.api_key, seed=seed, host=host,
                              weights_root=weights_root if e.weight_sync == "disk" else None, extra=extra)
    if e.launch == "sglang":
        python = e.sglang_python or sys.executable
        problem = sglang_problem(python)
        if problem:
            raise ConfigError(problem, key="engine.launch")
        return sglang_server(python, model, log_path, dtype=e.dtype, context_length=e.max_seq_len,
                             api_key=e.api_key, seed=seed, host=host, extra=extra)
    return vllm_server(e.vllm_python, model, log_path, dtype=e.dtype, max_model_len=e.max_seq_len,
                       api_key=e.api_key, seed=seed, host=host, extra=extra, lora_rank=lora_rank)


def relayrl_server(model: str, log_path: Path, *, dtype: str = "bfloat16", max_batch_size: int = 64,
                   max_seq_len: int | None = None, max_tokens_in_flight: int | None = None,
                   api_key: str | None = None, seed: int = 0, host: str = "127.0.0.1",
                   weights_root: str | Path | None = None, extra: Sequence[str] = ()) -> ManagedServer:
    """`relayrl serve` with this interpreter (so it runs the same relayrl as the trainer). `weights_root`
    (created here) enables /update_weights_from_disk for folders under it. A non-loopback host without an
    API key is passed --insecure, as launched servers always listened so; set engine.api_key to close it.
    `extra` (engine.server_args, e.g. --device cuda) comes last."""
    port = free_port(host)
    # no --log-level: the server logs at the run's level, RELAYRL_LOG_LEVEL (inherited)
    cmd = [sys.executable, "-m", "relayrl.cli", "serve", "--model", model, "--host", host, "--port", str(port),
           "--dtype", dtype, "--max-batch-size", str(max_batch_size), "--seed", str(seed)]
    if max_seq_len:
        cmd += ["--max-seq-len", str(max_seq_len)]
    if max_tokens_in_flight:
        cmd += ["--max-tokens-in-flight", str(max_tokens_in_flight)]
    if not api_key and not is_loopback(host):
        log.warning("relayrl serve on %s without an API key: anyone who can reach it can use it (set "
                    "engine.api_key)", host)
        cmd += ["--insecure"]
    if weights_root is not None:
        Path(weights_root).mkdir(parents=True, exist_ok=True)
        cmd += ["--weights-root", str(weights_root)]
    # the key through the environment: a process's arguments are visible to every local user, its environment not
    env = {KEY_ENV: api_key} if api_key else None
    return ManagedServer([*cmd, *extra], port, log_path, host=host, env=env, name="relayrl serve")


# vLLM's server environment: the CPU build (scripts/setup_vllm.sh), and its development routes (weight reloads,
# pause, resume)
_VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_SERVER_DEV_MODE": "1"}


def vllm_server(python: str, model: str, log_path: Path, *, dtype: str = "bfloat16",
                max_model_len: int | None = None, api_key: str | None = None, seed: int = 0,
                host: str = "127.0.0.1", extra: Sequence[str] = (), lora_rank: int = 0) -> ManagedServer:
    """vLLM's OpenAI server run by the interpreter of its own virtualenv (vLLM pins its own torch and
    transformers, so it cannot share relayrl's environment); `extra` (engine.server_args) comes last. The API key
    travels in VLLM_API_KEY (arguments are visible to every local user). `lora_rank` > 0: LoRA enabled with a
    maximum rank vLLM accepts, and its run-time adapter routes on (the run loads each version's adapter)."""
    if not Path(python).exists():
        raise FileNotFoundError(f"engine.vllm_python: {python} does not exist (create it with scripts/setup_vllm.sh)")
    port = free_port(host)
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", host,
           "--port", str(port), "--dtype", dtype, "--seed", str(seed), "--enforce-eager"]
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    env = {**_VLLM_ENV, **({"VLLM_API_KEY": api_key} if api_key else {})}
    if lora_rank:
        cmd += ["--enable-lora", "--max-lora-rank", str(vllm_lora_rank(lora_rank))]
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    return ManagedServer([*cmd, *extra], port, log_path, host=host, name="vllm server", env=env)


_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values vLLM's --max-lora-rank accepts


def vllm_lora_rank(rank: int) -> int:
    """The smallest --max-lora-rank vLLM accepts that holds adapters of `rank` (it refuses other values)."""
    return next(r for r in _VLLM_LORA_RANKS if r >= rank)  # the config caps model.lora_rank at 512 with vLLM


def sglang_server(python: str, model: str, log_path: Path, *, dtype: str = "bfloat16",
                  context_length: int | None = None, api_key: str | None = None, seed: int = 0,
                  host: str = "127.0.0.1", extra: Sequence[str] = ()) -> ManagedServer:
    """SGLang's server: `python -m sglang.launch_server --model-path M --host H --port P --dtype D --random-seed S
    [--context-length L] [--api-key K]`, then `extra` (engine.server_args: --tp-size, --mem-fraction-static, ...).
    It speaks the native API relayrl serve copies (weight reloads from disk, SGLang's broadcast), and runs only
    where CUDA is (`sglang_problem`)."""
    port = free_port(host)
    cmd = [python, "-m", "sglang.launch_server", "--model-path", model, "--host", host, "--port", str(port),
           "--dtype", dtype, "--random-seed", str(seed)]
    if context_length:
        cmd += ["--context-length", str(context_length)]
    if api_key:
        cmd += ["--api-key", api_key]
    return ManagedServer([*cmd, *extra], port, log_path, host=host, name="sglang server")


# asks the interpreter SGLang would run in whether it has sglang and, if so, whether its torch sees a CUDA device
_SGLANG_PROBE = """import importlib.util, json
found = importlib.util.find_spec("sglang") is not None
if found:
    import torch
print(json.dumps({"sglang": found, "cuda": found and torch.cuda.is_available()}))
"""


@functools.cache
def sglang_problem(python: str) -> str | None:
    """Why SGLang cannot start from `python` on this machine, in one line (None: it can)."""
    if not Path(python).exists():
        return f"sglang: engine.sglang_python {python} does not exist"
    try:
        out = subprocess.run([python, "-c", _SGLANG_PROBE], capture_output=True, text=True, timeout=120, check=True)
        found = json.loads(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError) as e:
        return f"sglang: cannot run {python} (engine.sglang_python): {e}"
    if not found["sglang"]:
        return (f"sglang is not installed for {python} (engine.sglang_python). SGLang runs only where CUDA is: "
                "install it there (pip install 'sglang[all]'), or use engine.launch=relayrl or vllm")
    if not found["cuda"]:
        return f"sglang runs only where CUDA is, and {python} sees no CUDA device; use engine.launch=relayrl or vllm"
    return None


def check_launch(e: EngineConfig) -> None:
    """engine.server_args tried on the launched server's own parser, before any model loads: a ConfigError naming
    engine.server_args for an argument it refuses or a flag relayrl sets itself (however abbreviated). The
    config has refused the plain spellings of those flags already (EngineConfig.validate)."""
    args = e.launch_args
    if not (e.launched_servers and args):
        return
    if e.launch == "relayrl":
        problem = relayrl_args_problem(args)
    elif e.launch == "vllm":
        problem = vllm_args_problem(e.vllm_python, args)
    else:  # SGLang's parser is importable only where it is installed, i.e. on a CUDA machine
        problem = None
    if problem:
        raise ConfigError(problem, key="engine.server_args")


class _Refused(Exception):
    pass


class _RefusingParser(argparse.ArgumentParser):
    """A parser that raises instead of printing usage and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _Refused(message)


_UNSET = object()
_PLACEHOLDER = "\0model"  # the model relayrl passes; any other value means server_args set --model again


def _reserved_given(ns: argparse.Namespace, launch: str) -> str | None:
    """The first flag of SERVER_FLAGS[launch] that the parsed arguments set (their defaults were _UNSET)."""
    for flag in SERVER_FLAGS[launch]:
        value = getattr(ns, flag[2:].replace("-", "_"), _UNSET)
        if value is not _UNSET and value != _PLACEHOLDER:
            return flag
    return None


def relayrl_args_problem(args: list[str]) -> str | None:
    """Why `relayrl serve` would refuse `args` after relayrl's own flags, judged by its own parser (None: fine)."""
    parser = serve_parser(_RefusingParser)
    parser.set_defaults(**{f[2:].replace("-", "_"): _UNSET for f in SERVER_FLAGS["relayrl"] if f != "--model"})
    try:
        ns = parser.parse_args(["--model", _PLACEHOLDER, *args])
    except _Refused as refusal:
        return f"relayrl serve refuses them: {refusal} (relayrl serve --help lists its options)"
    flag = _reserved_given(ns, "relayrl")
    return reserved_flag_problem("relayrl", [flag]) if flag else None


# tries engine.server_args on vLLM's own server parser, in vLLM's interpreter; prints one marked JSON line (its
# logging may print to stdout too)
_VLLM_CHECK = """import json, sys
args, flags = json.loads(sys.argv[1]), json.loads(sys.argv[2])
def say(**kw):
    print("RELAYRL-CHECK " + json.dumps(kw))
    sys.exit()
try:
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:
        from vllm.utils import FlexibleArgumentParser
    from vllm.entrypoints.openai.cli_args import make_arg_parser
except Exception as e:
    say(skip=f"{type(e).__name__}: {e}")
class Refused(Exception):
    pass
class Parser(FlexibleArgumentParser):
    def error(self, message):
        raise Refused(message)
unset = object()
parser = make_arg_parser(Parser())
parser.set_defaults(**{f[2:].replace("-", "_"): unset for f in flags if f != "--model"})
try:
    ns = parser.parse_args(["--model", "\\0model", *args])
except Refused as e:
    say(error=str(e))
given = [f for f in flags if getattr(ns, f[2:].replace("-", "_"), unset) not in (unset, "\\0model")]
say(given=given)
"""


def vllm_args_problem(python: str, args: list[str], timeout: float = 180.0) -> str | None:
    """Why vLLM's server would refuse `args`, judged by its own parser in `python` (engine.vllm_python). Without
    that interpreter (or when vLLM does not import there) the check is skipped with a warning: the launch itself
    then reports what is missing."""
    if not Path(python).exists():
        log.warning("engine.server_args not checked: engine.vllm_python %s does not exist (scripts/setup_vllm.sh)",
                    python)
        return None
    try:
        out = subprocess.run([python, "-c", _VLLM_CHECK, json.dumps(args), json.dumps(list(SERVER_FLAGS["vllm"]))],
                             capture_output=True, text=True, timeout=timeout, env={**os.environ, **_VLLM_ENV})
    except subprocess.TimeoutExpired:
        log.warning("engine.server_args not checked: vLLM's parser did not answer within %.0f s", timeout)
        return None
    found = next((json.loads(line.split(" ", 1)[1]) for line in reversed(out.stdout.splitlines())
                  if line.startswith("RELAYRL-CHECK ")), {"skip": out.stderr.strip()[-500:]})
    if "skip" in found:
        log.warning("engine.server_args not checked: vLLM's parser is not importable in %s (%s)", python,
                    found["skip"])
        return None
    if "error" in found:
        return f"vLLM's server refuses them: {found['error']}"
    return reserved_flag_problem("vllm", found["given"][:1]) if found["given"] else None
