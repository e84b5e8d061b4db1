#!/usr/bin/env bash
# GPU check: on a machine with CUDA, run the GPU tests (pytest -m gpu: engine logprob parity, a train step, weight
# sync, a colocated run, all on the tiny random model; with 2+ GPUs the multi-GPU stage), the rollout and train-step benches on the GPU, one GRPO step
# against TRL's GRPOTrainer on the GPU (where TRL is installed), a short
# GSM8K GRPO run through the CLI on the GPU and the decode-step probes (`bench/engine.py engine_step_parts` with the
# engine's CUDA graphs and without, `bench/engine.py decode_profile` with and without SDPA's cuDNN backend; the
# rollout bench has a
# graph-less LocalEngine side too) and, with real weights, time to accuracy sync vs async, writing
# bench/results/gpu_*. Without CUDA it says so and exits 0, running nothing.
# Nothing is downloaded: the tests build the tiny random model; the benches and the run use MODEL (default the
# SmolLM2 folder scripts/setup.sh prepared; on a machine the weights can't reach, a folder of SmolLM2's shape and
# tokenizer with random weights: `bench/train.py random_model`); GSM8K comes from disk ($RELAYRL_GSM8K_DIR or the
# default).
#
#   bash scripts/gpu_check.sh            # PYTHON=path/to/python for another interpreter than .venv's, MODEL=folder
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
MODEL=${MODEL:-smollm2}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1

if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    "$PY" -c 'import torch; print(f"gpu_check: CUDA is not available (torch {torch.__version__}, CUDA build: "
                                  f"{torch.version.cuda}); no GPU tests or benches were run.")'
    exit 0
fi
"$PY" -c 'import torch; print("gpu_check: on", torch.cuda.get_device_name(0), "| torch", torch.__version__)'

# what the benches read, checked before anything runs (scripts/setup.sh prepares both)
MODEL="$MODEL" "$PY" - <<'PYEOF'
import os, sys
from relayrl.data import find_gsm8k
from relayrl.models import resolve_model_path
try:
    resolve_model_path(os.environ["MODEL"], prepare=False)
    find_gsm8k("test"), find_gsm8k("train")
except FileNotFoundError as e:
    sys.exit(f"gpu_check: {e}\n(run scripts/setup.sh first, or set MODEL; this script downloads nothing)")
PYEOF

# every step runs even when one before it failed (a GPU machine is scarce: one pass should say everything), each
# under a time limit; the script fails at the end naming the steps that failed
failed=()
step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2; shift 2
    echo "gpu_check: == $name"
    local t0=$SECONDS
    if timeout "$limit" "$@"; then echo "gpu_check: $name passed in $((SECONDS - t0)) s"
    else echo "gpu_check: $name FAILED (exit $?) after $((SECONDS - t0)) s"; failed+=("$name"); fi
}
mkdir -p bench/results
run_dir=$(mktemp -d)
step tests 300 "$PY" -m pytest -m "gpu and not multigpu" -q -rs -p no:cacheprovider
# the multi-GPU stage: FSDP2 over NCCL, an NCCL weight broadcast into an engine on another GPU, Ray placing a trainer
# rank on each GPU (tests/e2e/test_multigpu.py); with one GPU it is skipped, and says so
gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
if [ "$gpus" -ge 2 ]; then
    step multigpu 900 "$PY" -m pytest -m multigpu -q -rs -p no:cacheprovider
else
    echo "gpu_check: multigpu SKIPPED: this machine has $gpus GPU; FSDP2 over NCCL, the NCCL weight broadcast and" \
        "Ray over several GPUs need two or more (tests/e2e/test_multigpu.py)"
fi
# where a decode step's time goes (relayrl's engine vs the bare model call), with the engine's CUDA graphs and without,
# and the bare call with SDPA's cuDNN backend off (relayrl's setting) and on (torch's own choice): the checks of
# relayrl.engine.decode_graphs and relayrl.common.device.avoid_cudnn_attention
step engine_step_parts 200 "$PY" bench/engine.py engine_step_parts --model "$MODEL" --device cuda --prompts 4 \
    --group 8 --out bench/results/gpu_engine_step_parts_4x8.json
step engine_step_parts_eager 200 "$PY" bench/engine.py engine_step_parts --model "$MODEL" --device cuda \
    --prompts 4 --group 8 --no-cuda-graphs --out bench/results/gpu_engine_step_parts_4x8_eager.json
step decode_profile 120 bash -c "'$PY' bench/engine.py decode_profile '$MODEL' cuda \
    > bench/results/gpu_decode_profile.txt \
    && '$PY' bench/engine.py decode_profile '$MODEL' cuda --cudnn > bench/results/gpu_decode_profile_cudnn.txt"
step rollout 400 "$PY" bench/engine.py rollout --device cuda --sides local,local_eager,hf --model "$MODEL" \
    --out bench/results/gpu_rollout.json
step train_step 300 "$PY" bench/train.py train_step --device cuda --model "$MODEL" \
    --out bench/results/gpu_train_step.json
# one GRPO step, relayrl vs TRL's GRPOTrainer (HF generate), both on the GPU: only where TRL is installed
if "$PY" -c 'import trl' 2>/dev/null; then
    step grpo_step_vs_trl 400 "$PY" bench/grpo_step_vs_trl.py --device cuda --model "$MODEL" --steps 3 \
        --out bench/results/gpu_grpo_step_vs_trl.json
else
    echo "gpu_check: grpo_step_vs_trl skipped (needs TRL: pip install '.[bench]')"
fi
step grpo_run 300 "$PY" -m relayrl train --config examples/gsm8k_grpo.yaml model.path="$MODEL" run.device=cuda \
    run.steps=4 eval.at_start=false eval.at_end=false run.output_dir="$run_dir" run.tensorboard=false
[ -f "$run_dir"/gsm8k_grpo/metrics.jsonl ] && cp "$run_dir"/gsm8k_grpo/metrics.jsonl bench/results/gpu_grpo_run.jsonl
# time to 60% held-out pass@1, sync vs async in a separate process, answers capped at 512 tokens (a long tail): only
# with real weights (a random model never learns) and reasoning-gym (the example's data); ~4 minutes on an H100;
# TTA=0 skips it
model_dir=$("$PY" -c 'import sys; from relayrl.models import resolve_model_path as r
print(r(sys.argv[1], prepare=False))' "$MODEL")
if [ "${TTA:-1}" = 1 ] && [ ! -f "$model_dir/RANDOM_WEIGHTS" ] && "$PY" -c 'import reasoning_gym' 2>/dev/null; then
    step time_to_accuracy 420 "$PY" bench/time_to_accuracy.py --model "$MODEL" --sides sync,async --separate \
        --staleness 2 --eval-every 5 --budget-min 1.5 --max-steps 40 --out bench/results/gpu_time_to_accuracy.json \
        --plot bench/results/gpu_time_to_accuracy.png --override run.device=cuda sampling.max_new_tokens=512 \
        engine.max_batch_size=256 scheduler.transport=dist
else
    echo "gpu_check: time_to_accuracy skipped (needs real weights, not a bench/train.py random_model folder," \
        "and reasoning-gym)"
fi
if [ ${#failed[@]} -gt 0 ]; then echo "gpu_check: FAILED: ${failed[*]}"; exit 1; fi
echo "gpu_check: all passed; results in bench/results/gpu_*"
