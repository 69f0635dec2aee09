#!/usr/bin/env bash
# Data-parallel training on one node with the deepspeed launcher (it appends --local_rank=N, which
# train/__main__.py turns into LOCAL_RANK). NUM_GPUS defaults to every visible GPU.
# Usage: launch/deepspeed.sh [hydra overrides...]    e.g. NUM_GPUS=8 launch/deepspeed.sh train.max_steps=1000
set -euo pipefail
cd "$(dirname "$0")/.."
exec deepspeed ${NUM_GPUS:+--num_gpus "$NUM_GPUS"} --module train "$@"
