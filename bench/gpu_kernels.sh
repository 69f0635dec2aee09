#!/usr/bin/env bash
# Triton kernels on one GPU: bf16 correctness against the fp32 reference, the kernel benchmark, then one CSA2 layer
# of each mode. Usage (repository root): OUT=some/dir bash bench/gpu_kernels.sh
#   -> gpu.txt, check.log/json, bench.log/json, layers.log/json. Each stage has its own timeout (seconds) so that a
#   hang in one leaves the others' results. The first calls compile and autotune every kernel config (about 2-3 min
#   in the check; Triton's disk cache serves the later stages), so the whole script takes about 8-10 minutes.
set -u
OUT=${OUT:-/tmp/csa2_kernel_bench}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TRITON_PRINT_AUTOTUNING=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,memory.used,temperature.gpu \
  --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" | tee -a "$OUT/gpu.txt"
timeout "${CHECK_TIMEOUT:-300}" python3 bench/bench_kernels.py check --out "$OUT/check.json" 2>&1 | tee "$OUT/check.log"
timeout "${BENCH_TIMEOUT:-300}" python3 bench/bench_kernels.py bench --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
timeout "${LAYERS_TIMEOUT:-135}" python3 bench/bench_layers.py --out "$OUT/layers.json" 2>&1 | tee "$OUT/layers.log"
