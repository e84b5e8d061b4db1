#!/usr/bin/env bash
# Optional: `verifiers` (Prime Intellect's environments library) in its own virtualenv, .venv-verifiers, for
# `agent.kind: verifiers` (relayrl/agents/verifiers.py) and its tests. verifiers pins mcp==2.0.0 and openai<3,
# which conflict with relayrl's `agents` extra, so it cannot share relayrl's .venv; relayrl is not installed in it
# (relayrl/envs/verifiers_runner.py, the program relayrl runs there, imports only verifiers). `uv` is installed next
# to it: verifiers' harnesses run their chat programs as uv scripts; the script environment of the chat program
# (the `null` and `bash` harnesses) is prepared here, from PyPI, so episodes do not wait for it. Safe to re-run.
# Add your environment's package to it: .venv-verifiers/bin/pip install -e path/to/my_env
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv-verifiers/bin/python ] || "$PY" -m venv .venv-verifiers
PIP=".venv-verifiers/bin/pip --disable-pip-version-check -q"
$PIP install "verifiers==0.4.0" "uv==0.13.9"
PATH="$PWD/.venv-verifiers/bin:$PATH" .venv-verifiers/bin/python - <<'PY'
import asyncio

import verifiers
import verifiers.v1 as vf
from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
from verifiers.v1.runtimes.subprocess import SubprocessRuntime



async def prepare() -> None:
    runtime = SubprocessRuntime(vf.SubprocessConfig())
    await runtime.start()
    try:
        await runtime.prepare_uv_script(CHAT_PROGRAM_SOURCE)
    finally:
        await runtime.teardown()


asyncio.run(prepare())
print("verifiers", verifiers.__version__, "is set up in .venv-verifiers")
PY
