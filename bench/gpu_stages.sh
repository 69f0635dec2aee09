# The budgeted stage runner the one-call GPU scripts share (bench/gpu_kernels.sh, bench/gpu_v41.sh): sourced, not
# run. A device call has one time limit and brings back at most 8 files, so each stage runs under `timeout`, capped
# by what is left of the call's BUDGET, its output goes to $OUT/<stage>.log, and the GPU's line (gpu.txt), each
# stage's exit code and seconds (stages.txt) and the logs are folded into one logs.txt at the end; a cut call still
# returns the stages that finished.
#   stages_begin <default budget seconds>   # after `cd` to the repository root, with OUT, SMOKE and SCALE set
#   stage <name> <cap seconds> command...   # ONLY="a b" runs only the named stages
#   stages_end
# CSA2_CODE=<commit> is required on the GPU (the GPU copy's .git can be stale: bench/result_meta.py labels the
# files from it). The carried wheels (.whl/, for deepspeed, hydra-core, omegaconf) are installed first when present;
# SITE is the prefix they add to PYTHONPATH.

stages_begin() {
  : "${OUT:?set OUT to the directory for the results}"
  mkdir -p "$OUT"
  BUDGET=${BUDGET:-$1}
  if [ "$SMOKE" != 1 ] && [ -z "${CSA2_CODE:-}" ]; then
    echo "error: set CSA2_CODE=<commit> so that the result files name the code they measured" >&2
    exit 2
  fi
  export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} OUT
  SITE=
  if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    SITE=/tmp/site:
  fi
  export PYTHONPATH=$SITE$PWD
  if [ "$SMOKE" != 1 ]; then
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.used,memory.total,temperature.gpu \
      --format=csv | tee "$OUT/gpu.txt"
  fi
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    | tee -a "$OUT/gpu.txt"
}

stage() {  # name cap_seconds command...: run under the smaller of cap x SCALE and the budget left; log rc, seconds
  local name=$1 cap=$(( $2 * SCALE )); shift 2
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
  local left=$(( BUDGET - SECONDS ))
  local limit=$(( cap < left ? cap : left ))
  if [ "$limit" -lt 20 ]; then
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

stages_end() {  # the stages' summary; the GPU, the summary and every stage's log in one logs.txt (2026-12-01: a call
  # lost its step files to the logs; 2026-12-07: gpu_v41.sh's six result files with gpu.txt and stages.txt were 9)
  echo "total ${SECONDS}s of ${BUDGET}s"; cat "$OUT/stages.txt" 2> /dev/null
  { cat "$OUT/gpu.txt" "$OUT/stages.txt" 2> /dev/null
    for log in "$OUT"/*.log; do echo "==== $(basename "$log")"; cat "$log"; done; } > "$OUT/logs.txt.tmp" &&
    mv "$OUT/logs.txt.tmp" "$OUT/logs.txt" && rm -f "$OUT"/*.log "$OUT/gpu.txt" "$OUT/stages.txt"
}
