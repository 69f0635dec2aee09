#!/usr/bin/env bash
# Data-parallel training on one node with the deepspeed launcher (it appends --local_rank=N, which
# train/__main__.py turns into LOCAL_RANK). NUM_GPUS defaults to every visible GPU.
# Usage: launch/deepspeed.sh [hydra overrides...]    e.g. NUM_GPUS=8 launch/deepspeed.sh train.max_steps=1000
# A failed job restarts up to MAX_RESTARTS times (launch/restarts.sh) in its pinned run directory (RUN_DIR, default
# outputs/deepspeed-<start time>), resuming from the newest intact checkpoint (train.resume=auto).
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/restarts.sh
restarting deepspeed ${NUM_GPUS:+--num_gpus "$NUM_GPUS"} --module train \
  hydra.run.dir="${RUN_DIR:-outputs/deepspeed-$(date +%Y-%m-%d_%H-%M-%S)}" train.resume=auto "$@"
