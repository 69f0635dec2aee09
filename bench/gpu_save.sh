#!/usr/bin/env bash
# A checkpoint save and a resume timed on one GPU (issue 53): bench/save_timing.py, synchronous save against
# asynchronous (the stall the step sees), by phase, with the bytes and a projection to V4.1. One JSON per stage.
#   CSA2_CODE=<commit> OUT=<dir> bash bench/gpu_save.sh   # from the repository root; BUDGET seconds (default 580)
#   SMOKE=1 OUT=<dir> bash bench/gpu_save.sh              # the same stages on the CPU: the tiny model, fp32
#   ONLY=small_moe OUT=<dir> bash bench/gpu_save.sh
# Stages (file under $OUT -> bench/results/checkpoints/), the issue's model first; each may take most of a call
# (2026-12-07, H100: `small` had not finished at its 170 s limit, its log silent after the job's start), so run
# `ONLY=small_moe` in a call of its own. The JSON is rewritten after each phase (sync, async, resume:
# `phases_done`), so a cut stage keeps those done:
#   small      save_timing_small.json: `model=small layout=v41` at 4K tokens (3.16 B parameters, ~38 GB a checkpoint)
#   small_moe  save_timing_small_moe.json: `model=small_moe layout=v41` at 4K: 3.4 B parameters, ~54 GB a checkpoint
# The checkpoints go under WORK (default /tmp/save_timing; the machine's disk is 64 GB: one checkpoint at a time,
# removed after each stage). The GPU, exit codes and seconds, and the stage logs in logs.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_stages.sh
SMOKE=${SMOKE:-0}
WORK=${WORK:-/tmp/save_timing}

if [ "$SMOKE" = 1 ]; then  # the CPU: the tiny model whatever the stage's model; limits x 2
  SCALE=2
  JOB=(--smoke)
  FORCE_MODEL=tiny
else
  SCALE=1
  JOB=(layout=v41 data.seq_len=4096)
  FORCE_MODEL=
fi
stages_begin 580
export CSA2_KERNEL_POISON=0

RUN=(python3 bench/save_timing.py --work-dir "$WORK" "${JOB[@]}")
stage small 560 "${RUN[@]}" --out "$OUT/save_timing_small.json" "model=${FORCE_MODEL:-small}"
rm -rf "${WORK:?}"  # one checkpoint on the disk at a time
stage small_moe 560 "${RUN[@]}" --out "$OUT/save_timing_small_moe.json" "model=${FORCE_MODEL:-small_moe}"
rm -rf "${WORK:?}"
stages_end
