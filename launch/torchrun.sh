#!/usr/bin/env bash
# Data-parallel training on one node with torchrun: NPROC processes (default: one per GPU, or 2 on CPU).
# torchrun through train/torchrun.py: a failed job ends with its workers' status (2: bad input) and one line.
# Usage: launch/torchrun.sh [hydra overrides...]    e.g. NPROC=4 launch/torchrun.sh train.max_steps=1000
# A failed worker (a crash, a kill -9) restarts the whole group up to MAX_RESTARTS times (default 3): the run
# directory is pinned (RUN_DIR, default outputs/torchrun-<start time>) and train.resume=auto continues from its newest
# intact checkpoint. Run the script again with the same RUN_DIR to continue a stopped run.
set -euo pipefail
cd "$(dirname "$0")/.."
# NPROC unset: one per GPU, counted by torch (a second of imports, so only then)
nproc=${NPROC:-$(python -c "import torch; print(torch.cuda.device_count() or 2)")}
exec python -m train.torchrun --standalone --nproc-per-node "$nproc" --max-restarts "${MAX_RESTARTS:-3}" \
  -m train hydra.run.dir="${RUN_DIR:-outputs/torchrun-$(date +%Y-%m-%d_%H-%M-%S)}" train.resume=auto "$@"
