"""`ExternalAgent` (`agent.kind: external`): an agent program of the user's, in any language or framework, run as a
subprocess per episode and trained on through the OpenAI-compatible endpoint it talks to.

Per episode the program gets:
- `OPENAI_BASE_URL` (`http://127.0.0.1:PORT/ep/<episode id>/v1`) and `OPENAI_API_KEY` (this episode's key), so
  `openai.OpenAI()` with no arguments, and the frameworks built on it, talk to relayrl's engines
  (relayrl.agents.proxy); `RELAYRL_EPISODE_ID` too;
- the episode's dataset row as one JSON object on stdin (then stdin closes).

Every chat completion is recorded token-exactly (prompt ids, output ids, logprobs, policy versions) as
`OpenAIAgent` records them: calls whose messages extend the previous call's conversation with its reply become
one growing trajectory; a call that rewrites history starts a new sample of the same group, sharing the episode's
reward (relayrl.agents.openai_agent.session_samples).

The reward: the program's last non-empty stdout line, when it is a JSON object with a `reward` key (a number;
`null` leaves it to the judge), optionally with `"metrics": {name: number}` logged with the sample. Without
one, the run's judge scores the last reply the program received.

A program that fails costs its episode (its samples FAILED, counted in rollout/failed), never the run: a
non-zero exit, no call at all, still running after `timeout` seconds, or a call past the caps (`max_calls`,
`max_tokens`: refused with HTTP 429, then the program is stopped). Each program runs in a process group of its
own, and the whole group is killed when its episode ends, however it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import signal
from typing import TYPE_CHECKING, Any

from relayrl.agents.base import AGENTS, Agent
from relayrl.agents.openai_agent import RecordingBackend, Session, finish_session
from relayrl.common.errors import InputError, install_hint
from relayrl.sample import Sample

if TYPE_CHECKING:  # the proxy serves with uvicorn, the serve extra: imported when the first episode starts
    from relayrl.agents.proxy import Episode, EpisodeProxy

_TAIL = 64 * 1024  # bytes of a program's stdout and stderr kept (the reward line, the error's tail)


@AGENTS.register("external")
class ExternalAgent(Agent):
    def __init__(self, rollout_ctl, tokenizer, sampling, judge=None, *, command: list[str] | str,
                 timeout: float = 300.0, max_calls: int = 32, max_tokens: int | None = None,
                 env: dict[str, str] | None = None, cwd: str | None = None):
        super().__init__(rollout_ctl, tokenizer, sampling, judge)
        # this class's check (a subclass's own check_kwargs reads the subclass's options)
        ExternalAgent.check_kwargs(dict(command=command, timeout=timeout, max_calls=max_calls, max_tokens=max_tokens))
        self.command = shlex.split(command) if isinstance(command, str) else [str(c) for c in command]
        self.timeout, self.max_calls, self.env, self.cwd = timeout, max_calls, dict(env or {}), cwd
        self.max_tokens = max_tokens if max_tokens is not None else max_calls * sampling.max_new_tokens
        self.backend = RecordingBackend(rollout_ctl, tokenizer, sampling)
        self._proxy: EpisodeProxy | None = None

    @classmethod
    def check_kwargs(cls, kwargs: dict[str, Any]) -> None:
        """Before any model loads: a command to run, and caps that allow at least one call."""
        command = kwargs.get("command")
        if not command or not (isinstance(command, str) or all(isinstance(c, str | int | float) for c in command)):
            raise InputError("agent.kwargs.command is required: the program to run, e.g. [python, my_agent.py]")
        for key in ("timeout", "max_calls", "max_tokens"):
            value = kwargs.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value <= 0):
                raise InputError(f"agent.kwargs.{key} must be a positive number, got {value!r}")
        try:
            import uvicorn  # noqa: F401
        except ImportError:
            raise InputError(f"agent.kind external serves its programs with uvicorn: {install_hint('serve')}") \
                from None

    def proxy(self) -> EpisodeProxy:
        """The endpoint, started on the first episode (building an agent opens no port)."""
        if self._proxy is None:
            from relayrl.agents.proxy import EpisodeProxy

            self._proxy = EpisodeProxy(self.backend, self.sampling.max_new_tokens)
        return self._proxy

    async def generate_sample(self, sample: Sample) -> list[Sample]:
        proxy = self.proxy()
        session = Session(sample.uid, self.judge, sample.data)
        ep = proxy.open(session, self.max_calls, self.max_tokens)
        try:
            stdout = await self._run(ep, proxy.base_url(ep), sample)
        finally:
            proxy.close(ep)
        result, metrics = program_result(stdout)
        samples = await finish_session(session, sample, result, self.judge, 1.0, self.decode)
        for s in samples:
            s.metrics.update(metrics)
        return samples

    async def _run(self, ep: Episode, base_url: str, sample: Sample) -> str:
        """Run the program for one episode; its stdout, or an error saying why the episode failed."""
        env = os.environ | self.env | {"OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": ep.key,
                                       "RELAYRL_EPISODE_ID": ep.id}
        proc = await asyncio.create_subprocess_exec(
            *self.command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=env, cwd=self.cwd, start_new_session=True)
        row = json.dumps(sample.data, default=str).encode() + b"\n"
        done = asyncio.ensure_future(asyncio.gather(_feed(proc, row), _tail(proc.stdout), _tail(proc.stderr),
                                                    proc.wait()))
        try:
            failed = asyncio.ensure_future(ep.failed.wait())
            await asyncio.wait({done, failed}, timeout=self.timeout, return_when=asyncio.FIRST_COMPLETED)
            failed.cancel()
            if ep.failure is not None:
                raise RuntimeError(f"external agent {self.name()}: {ep.failure} (refused with HTTP 429; stopped)")
            if not done.done():
                raise RuntimeError(f"external agent {self.name()} still running after {self.timeout} s: killed")
            _, out, err, code = done.result()
        finally:
            kill_group(proc)
            await _settle(done)
        if code != 0:
            raise RuntimeError(f"external agent {self.name()} exited with code {code}: "
                               f"{err.decode(errors='replace')[-800:]}")
        return out.decode(errors="replace")

    def name(self) -> str:
        return shlex.join(self.command)[:200]

    def close(self) -> None:
        if self._proxy is not None:
            self._proxy.stop()
            self._proxy = None


async def _feed(proc: asyncio.subprocess.Process, data: bytes) -> None:
    """Write the row to the program's stdin and close it; a program that never reads it is not an error."""
    assert proc.stdin is not None
    try:
        proc.stdin.write(data)
        await proc.stdin.drain()
        proc.stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        pass


async def _tail(stream: asyncio.StreamReader | None) -> bytes:
    """Everything the program writes to `stream`, keeping only the last _TAIL bytes (a flood of output costs no
    memory)."""
    kept = b""
    while stream is not None and (chunk := await stream.read(65536)):
        kept = (kept + chunk)[-_TAIL:]
    return kept


async def _settle(done: asyncio.Future) -> None:
    """Let the killed program's pipes drain and its exit be reaped; a process that escaped the group (setsid)
    and still holds the pipes is stopped being read after a few seconds."""
    try:
        await asyncio.wait_for(asyncio.shield(done), 5.0)
    except BaseException:  # timed out, or the program's own failure (reported by the caller)
        done.cancel()


def kill_group(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL the program's process group (it leads its own session): children it started die with it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def program_result(stdout: str) -> tuple[float | None, dict[str, float]]:
    """(reward, metrics) from the program's last non-empty stdout line when it is a JSON object with `reward`;
    (None, {}) otherwise (the judge decides). A `reward` that is not a number fails the episode."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    try:
        last = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        return None, {}
    if not isinstance(last, dict) or "reward" not in last:
        return None, {}
    reward, metrics = last["reward"], last.get("metrics") or {}
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, int | float)):
        raise ValueError(f"the program's result line has a reward that is not a number: {reward!r:.80}")
    if not isinstance(metrics, dict) or not all(isinstance(v, int | float) for v in metrics.values()):
        raise ValueError("the program's result line has metrics that are not {name: number}")
    return (None if reward is None else float(reward)), {str(k): float(v) for k, v in metrics.items()}
