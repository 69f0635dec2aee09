#!/usr/bin/env bash
# Issue 34's measurements in one GPU call (one H200), every result as JSON under $OUT as soon as it exists, the most
# valuable first, so a cut call still brings back the earlier ones.
#   CSA2_CODE=<commit> OUT=<dir> bash bench/gpu_v41.sh   # from the repository root; BUDGET seconds (default 530)
#   SMOKE=1 OUT=<dir> bash bench/gpu_v41.sh              # the same sequence on the CPU at tiny shapes
#   ONLY="moe_ffn" OUT=<dir> bash bench/gpu_v41.sh       # only the named stages (a rerun)
# Stages (file under $OUT -> bench/results/...):
#   0. hyper            hyper_check.json, hyper_bench.json: the stream's collapse/expand kernels against the
#                       reference (bench/bench_kernels.py check_hyper, bench_hyper)         -> kernels/
#   1. train_small_moe  train_step_small_moe_65536.json: `model=small_moe layout=v41` at 64K, whole step: tokens/s,
#                       MFU against the matmul rate of the same process, peak memory, tokens per expert, time per
#                       part (attention, MoE, mHC, Engram; forward, recomputation, backward), the Reuse layer's
#                       launches, the device time by kernel                                  -> train/
#      (train_small_moe_expandable: the same once more with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,
#       only if the first ran out of memory; same file name)
#   2. moe_ffn          moe_ffn.json: bench/moe_ffn.py, the routed experts' grouped GEMMs at V4.1 shapes against a
#                       dense GEMM chain of the same FLOPs, 256..4096 tokens per expert      -> kernels/
#   3. train_small      train_step_small_65536.json: `model=small` at 64K, the baseline, with its parts -> train/
# Stage logs in logs.txt, each stage's exit code and seconds in stages.txt, the GPU in gpu.txt: 6 files (a device
# call returns at most 8).
# Expected on a fresh H200 (estimates, not yet timed: the `small` stage of bench/gpu_kernels.sh took 119 s with its
# kernel table and a first compile, 62 s with the kernels compiled): small_moe ~150-200 s (Triton compile, build,
# 1 warm-up + 2 timed + 1 probed + 1 profiled step of ~6 s), moe_ffn ~40 s, small ~70 s.
# Each stage runs under `timeout`, capped by what is left of BUDGET. CSA2_CODE=<commit> (required on the GPU) labels
# the result files. The carried wheels (.whl/, for deepspeed, hydra-core, omegaconf) are installed first when present.
set -uo pipefail
: "${OUT:?set OUT to the directory for the results}"
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
SMOKE=${SMOKE:-0}
BUDGET=${BUDGET:-530}
if [ "$SMOKE" != 1 ] && [ -z "${CSA2_CODE:-}" ]; then  # the GPU copy's .git can be stale (bench/result_meta.py)
  echo "error: set CSA2_CODE=<commit> so that the result files name the code they measured" >&2
  exit 2
fi
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} CSA2_KERNEL_POISON=0 OUT
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi

if [ "$SMOKE" = 1 ]; then  # the CPU: v41_mini / tiny at 64 tokens, the PyTorch kernels, fp32; limits x 4
  SCALE=4
  MOE=(--device cpu model=v41_mini layout=v41_scaled data.seq_len=64 train.precision=fp32)
  SMALL=(--device cpu model=tiny layout=v41_scaled data.seq_len=64 train.precision=fp32)
  FFN=(--smoke)
  T=64
else
  SCALE=1
  MOE=(model=small_moe layout=v41)
  SMALL=(model=small layout=v41)
  FFN=()
  T=65536
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.used,memory.total,temperature.gpu \
    --format=csv | tee "$OUT/gpu.txt"
fi
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"

stage() {  # name cap_seconds command...: run under the smaller of cap and the budget left; log rc and seconds
  local name=$1 cap=$(( $2 * SCALE )); shift 2
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" ${name%_expandable} "* ]]; then return; fi
  local left=$(( BUDGET - SECONDS ))
  local limit=$(( cap < left ? cap : left ))
  if [ "$limit" -lt 30 ]; then
    echo "$name skipped: ${left}s left of ${BUDGET}s" | tee -a "$OUT/stages.txt"
    return
  fi
  echo "== $name (limit ${limit}s): $*"
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  grep -v -i -e warn -e USDT "$OUT/$name.log" | tail -n 12
  echo "$name rc=$rc ${limit}s-limit $(( SECONDS - start ))s" | tee -a "$OUT/stages.txt"
}

KB=(python3 bench/bench_kernels.py)
[ "$SMOKE" = 1 ] && KB+=(--smoke)
stage hyper 120 bash -c "${KB[*]} check --only check_hyper --out $OUT/hyper_check.json && \
  ${KB[*]} bench --only bench_hyper --out $OUT/hyper_bench.json"
STEP=(python3 bench/train_step.py --variant csa2 --steps 2 --warmup 1)
stage train_small_moe 280 "${STEP[@]}" --kernel-table --out "$OUT/train_step_small_moe_$T.json" "${MOE[@]}"
if grep -q -e OutOfMemoryError -e "CUDA out of memory" "$OUT/train_small_moe.log" 2> /dev/null; then
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True stage train_small_moe_expandable 200 "${STEP[@]}" \
    --out "$OUT/train_step_small_moe_$T.json" "${MOE[@]}"
fi
stage moe_ffn 100 python3 bench/moe_ffn.py "${FFN[@]}" --out "$OUT/moe_ffn.json"
stage train_small 150 "${STEP[@]}" --out "$OUT/train_step_small_$T.json" "${SMALL[@]}"
echo "total ${SECONDS}s of ${BUDGET}s"; cat "$OUT/stages.txt"
for log in "$OUT"/*.log; do echo "==== $(basename "$log")"; cat "$log"; done > "$OUT/logs.txt" && rm -f "$OUT"/*.log
