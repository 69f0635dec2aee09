#!/usr/bin/env bash
# Issue 6: a short real training run at 64K on one H200 -- `python -m train` itself (embedded stdlib data, the
# small model, V4.1 layout, 64K rows, layer recompute, bf16), metrics.jsonl under $OUT/run as every step ends,
# so a run cut short by the machine's time limit still brings back every finished step.
#   OUT=<dir> bash bench/gpu_train_run.sh [overrides...]
# On the lent GPU machine first install the carried wheels (see bench/gpu_train.sh).
# The loss plot is drawn at the end of a complete run; for a cut run, from metrics.jsonl with
# train.observe.metrics.plot_losses.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/train_run}
mkdir -p "$OUT"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} PYTHONUNBUFFERED=1 CSA2_KERNEL_POISON=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1 || true
python3 -m train model=small layout=v41 data.seq_len=65536 data.micro_batch_size=1 parallel.recompute=layer \
    train.precision=bf16 train.max_steps=300 train.warmup_steps=3 train.lr=6e-4 train.eval.every=0 \
    train.eval.batches=1 train.eval.probe_examples=0 train.checkpoint_every=100000 logger.mode=disabled \
    train.progress=false hydra.run.dir="$OUT/run" "$@" 2>&1 | tee "$OUT/train.log"
