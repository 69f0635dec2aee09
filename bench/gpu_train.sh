#!/usr/bin/env bash
# Issue 6 on one H200: whole-model training steps at 64K (CSA2 Triton), the dense-attention model, and the
# PyTorch-reference CSA2 path, each in its own process; JSON + logs under $OUT (default bench/results/train).
#   OUT=<dir> bash bench/gpu_train.sh [overrides...]
# On the lent GPU machine (no deepspeed/hydra there) first install the carried wheels:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PWD TORCH_CUDA_ARCH_LIST=9.0
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/train}
mkdir -p "$OUT"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} PYTHONUNBUFFERED=1 CSA2_KERNEL_POISON=0
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$OUT/gpu.txt" || true
python3 bench/train_step.py --all --out-dir "$OUT" --device cuda --steps 2 --warmup 1 \
    --dense-lens 65536,32768,16384 --reference-lens 4096,2048,1024 --timeout "${TIMEOUT:-540}" "$@" \
    2>&1 | tee "$OUT/train_step.log"
