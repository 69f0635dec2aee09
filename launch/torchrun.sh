#!/usr/bin/env bash
# Data-parallel training on one node with torchrun: NPROC processes (default: one per GPU, or 2 on CPU).
# torchrun through train/torchrun.py: a failed job ends with its workers' status (2: bad input) and one line.
# Usage: launch/torchrun.sh [hydra overrides...]    e.g. NPROC=4 launch/torchrun.sh train.max_steps=1000
set -euo pipefail
cd "$(dirname "$0")/.."
default_nproc=$(python -c "import torch; print(torch.cuda.device_count() or 2)")
exec python -m train.torchrun --standalone --nproc-per-node "${NPROC:-$default_nproc}" -m train "$@"
