#!/usr/bin/env bash
# Context parallelism's GPU check (issues 37, 55) on one GPU: a row's chunks through the Triton kernels against the
# whole row, C processes sharing the card (bench/context_check.py), every result as JSON under $OUT.
#   CSA2_CODE=<commit> OUT=<dir> bash bench/gpu_context.sh      # from the repository root; BUDGET seconds (default 560)
#   SMOKE=1 OUT=<dir> bash bench/gpu_context.sh                 # the same sequence on the CPU at tiny shapes
#   ONLY="c16k_2 halo16k_2" OUT=<dir> bash bench/gpu_context.sh # only the named stages
# Stages (file under $OUT -> bench/results/context/):
#   c16k_2, c16k_4    context_16384_c{2,4}.json: rows of 16K in C = 2 and 4 chunks; the stage passes (rc=0) when the
#                     chunks are within twice the yardstick's distance of the whole row
#   halo16k_2         context_16384_c2_no_halo.json: C = 2 with the window halo planted away: the check must fail,
#                     which the script reports as rc=0 ("as_expected": true, "passes": false)
#   c64k_2, c64k_4    context_65536_c{2,4}.json: rows of 64K
# The GPU, each stage's exit code and seconds, and the stage logs in logs.txt. Each stage runs under
# `timeout`, capped by what is left of BUDGET (bench/gpu_stages.sh). CSA2_CODE=<commit> (required on the GPU) labels
# the result files.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_stages.sh
SMOKE=${SMOKE:-0}

if [ "$SMOKE" = 1 ]; then  # the CPU: model=tiny, rows of 128 and 256, query blocks of a few queries; limits x 4
  SCALE=4
  CHECK=(python3 bench/context_check.py --smoke --block-gib 0.001)
  SHORT=128
  LONG=256
else
  SCALE=1
  CHECK=(python3 bench/context_check.py)
  SHORT=16384
  LONG=65536
fi
stages_begin 560
export CSA2_KERNEL_POISON=0

context() {  # stage cap seq_len chunks [--plant bug]: one check, its JSON named after its shape
  local name=$1 cap=$2 T=$3 C=$4; shift 4
  local file="context_${T}_c${C}${1:+_${2}}.json"
  stage "$name" "$cap" "${CHECK[@]}" --seq-len "$T" --chunks "$C" "$@" --out "$OUT/$file"
}

context c16k_2 120 $SHORT 2  # the first stage compiles the kernels
context halo16k_2 60 $SHORT 2 --plant no_halo
context c16k_4 60 $SHORT 4
context c64k_2 120 $LONG 2
context c64k_4 180 $LONG 4  # the yardstick alone took 81 s of C = 2's 117 s (2026-12-06)
stages_end
