"""`VerifiersAgent` (`agent.kind: verifiers`): a `verifiers` (0.4, `verifiers.v1`) environment trained as it is,
its rubric's reward as the reward.

verifiers pins `mcp` and `openai` versions that conflict with relayrl's extras, so it lives in a virtualenv of
its own (`.venv-verifiers`, made by scripts/setup_verifiers.sh) and runs there: this agent is the external agent
(relayrl.agents.external) whose program is relayrl/envs/verifiers_runner.py under that virtualenv's python. Per
episode the runner turns the row into one task of the environment's taskset, runs it with verifiers' own
harness and interception against the episode's recording endpoint, and prints the reward and each reward
function's score; everything the external agent does (token-exact recording, caps, killing) applies.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from relayrl.agents.base import AGENTS
from relayrl.agents.external import ExternalAgent
from relayrl.common.errors import InputError

RUNNER = Path(__file__).resolve().parents[1] / "envs" / "verifiers_runner.py"
PYTHON = ".venv-verifiers/bin/python"
_CHECK_TIMEOUT = 120.0  # seconds for the runner to import verifiers and the environment


@AGENTS.register("verifiers")
class VerifiersAgent(ExternalAgent):
    def __init__(self, rollout_ctl, tokenizer, sampling, judge=None, *, env: str,
                 env_config: dict[str, Any] | None = None, python: str = PYTHON, timeout: float = 300.0,
                 max_calls: int = 32, max_tokens: int | None = None, env_vars: dict[str, str] | None = None,
                 cwd: str | None = None):
        super().__init__(rollout_ctl, tokenizer, sampling, judge, command=runner_command(python, env, env_config),
                         timeout=timeout, max_calls=max_calls, max_tokens=max_tokens, env=env_vars, cwd=cwd)

    @classmethod
    def check_kwargs(cls, kwargs: dict[str, Any]) -> None:
        """Before any model loads: the virtualenv's python runs, and loads the environment (its taskset imports,
        its config validates), so a wrong id or option is one line, not a failed episode per sample."""
        env, config = kwargs.get("env"), kwargs.get("env_config")
        if not isinstance(env, str) or not env:
            raise InputError("agent.kwargs.env is required: the verifiers taskset id (an importable package)")
        if config is not None and not isinstance(config, dict):
            raise InputError(f"agent.kwargs.env_config must be a mapping (verifiers' env config), got {config!r}")
        python = str(kwargs.get("python") or PYTHON)
        cwd = kwargs.get("cwd")
        if not os.access(Path(cwd or ".") / python, os.X_OK):
            raise InputError(f"agent.kwargs.python: {python} does not exist; run `bash scripts/setup_verifiers.sh`"
                             " (verifiers needs its own virtualenv)")
        ExternalAgent.check_kwargs({k: v for k, v in kwargs.items() if k in ("timeout", "max_calls", "max_tokens")}
                                   | {"command": runner_command(python, env, config)})
        environ = os.environ | {str(k): str(v) for k, v in (kwargs.get("env_vars") or {}).items()}
        try:
            done = subprocess.run([*runner_command(python, env, config), "--check"], capture_output=True,
                                  text=True, env=environ, cwd=cwd, timeout=_CHECK_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise InputError(f"agent.kwargs.env: loading {env!r} took over {_CHECK_TIMEOUT:.0f} s") from None
        if done.returncode != 0:
            lines = [line for line in done.stderr.splitlines() if line.strip()] or ["(no error output)"]
            raise InputError(f"agent.kwargs.env: verifiers could not load {env!r}: {lines[-1][:500]}")


def runner_command(python: str, env: str, config: dict[str, Any] | None) -> list[str]:
    return [python, str(RUNNER), env, json.dumps(config or {})]
