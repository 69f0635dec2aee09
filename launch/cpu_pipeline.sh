#!/usr/bin/env bash
# Pipeline parallelism on one CPU machine (gloo): NPROC processes, STAGES stages (default 2 and 2), the
# variant the multi-process tests run. Extra arguments are Hydra overrides:
#   launch/cpu_pipeline.sh train.max_steps=20 parallel.cuts=[8]
set -euo pipefail
cd "$(dirname "$0")/.."
stages=${STAGES:-2}
exec torchrun --standalone --nproc-per-node "${NPROC:-$stages}" -m train train.device=cpu \
  parallel.pipeline_stages="$stages" train.grad_accum_steps="${MICROBATCHES:-$((2 * stages))}" "$@"
