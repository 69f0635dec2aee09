#!/usr/bin/env bash
# Issue 16 on nvidia-h200-x2: bench/multigpu.py on both GPUs in one call, results under $OUT. Run from the repo
# root with the carried wheels (.whl: ../shared/gpu/fetch-wheels.sh .whl):
#   OUT=<dir> bash bench/gpu_multigpu.sh [--budget SECONDS] [--sections single,transfer,...]
# Writes $OUT/multigpu.json (rewritten after every section), $OUT/layer_times_small_65536.json (the file
# parallel.layer_times reads), $OUT/multigpu.log, $OUT/gpu.txt and $OUT/topology.txt; copy them into
# bench/results/multigpu/. The whole call stays under 9 minutes: the benchmark's own budget (480 s by default, its
# optional parts skip to keep it) inside a hard limit of 510 s.
set -uo pipefail
: "${OUT:?set OUT}"
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
# NVLink multicast stays off (the machine kind's rule: it can take the host's GPUs out of service).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 CSA2_KERNEL_POISON=0
nvidia-smi --query-gpu=index,name,memory.used,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
nvidia-smi topo -m > "$OUT/topology.txt" 2>&1
timeout --signal=TERM --kill-after=10 510 python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
  bench/multigpu.py --out-dir "$OUT" "$@" 2>&1 | grep -v -i "warn" | tee "$OUT/multigpu.log"
echo "exit ${PIPESTATUS[0]}" | tee -a "$OUT/multigpu.log"
