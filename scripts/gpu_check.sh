#!/usr/bin/env bash
# GPU check: on a machine with CUDA, run the GPU tests (pytest -m gpu: engine logprob parity, a train step, weight
# sync, a colocated run, all on the tiny random model) and the rollout and train-step benches on the GPU
# (SmolLM2-135M-Instruct), writing bench/results/gpu_rollout.json and bench/results/gpu_train_step.json.
# Without CUDA it says so and exits 0, running nothing. Nothing is downloaded: the models are the tiny random
# model (built locally by the tests) and the SmolLM2 folder scripts/setup.sh prepared; GSM8K comes from disk.
#
#   bash scripts/gpu_check.sh            # PYTHON=path/to/python to use another interpreter than .venv's
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1

if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    "$PY" -c 'import torch; print(f"gpu_check: CUDA is not available (torch {torch.__version__}, CUDA build: "
                                  f"{torch.version.cuda}); no GPU tests or benches were run.")'
    exit 0
fi
"$PY" -c 'import torch; print("gpu_check: on", torch.cuda.get_device_name(0), "| torch", torch.__version__)'

# what the benches read, checked before anything runs (scripts/setup.sh prepares both)
"$PY" - <<'EOF'
import sys
from relayrl.data import find_gsm8k
from relayrl.models import resolve_model_path
try:
    resolve_model_path("smollm2", prepare=False)
    find_gsm8k("test"), find_gsm8k("train")
except FileNotFoundError as e:
    sys.exit(f"gpu_check: {e}\n(run scripts/setup.sh first; this script downloads nothing)")
EOF

"$PY" -m pytest -m gpu -q -rs
mkdir -p bench/results
"$PY" bench/rollout.py --device cuda --sides local,hf --out bench/results/gpu_rollout.json
"$PY" bench/train_step.py --device cuda --out bench/results/gpu_train_step.json
echo "gpu_check: tests passed; results in bench/results/gpu_rollout.json and bench/results/gpu_train_step.json"
