#!/usr/bin/env bash
# Issue 16 on nvidia-h200-x2: bench/multigpu.py on both GPUs in one call. From the repository root, after the
# prelude that installs the carried wheels into /tmp/site (PYTHONPATH=/tmp/site:$PWD):
#   OUT=<dir> bash bench/gpu_multigpu.sh [bench/multigpu.py options]       # GPU: about 7 minutes
#   OUT=<dir> bash bench/gpu_multigpu.sh --smoke                          # the same call on CPU (gloo, tiny model)
# Writes into $OUT/multigpu/ as it goes: multigpu.json (rewritten after every step), layer_times_small_65536.json
# (the file parallel.layer_times reads), multigpu.log (everything, warnings included), gpu.txt, topology.txt; copy
# the folder to bench/results/multigpu/. Time: the benchmark's own budget (390 s from its start; optional parts
# skip to keep it) inside a limit of LIMIT seconds (450) on torchrun, which ends it with SIGTERM.
set -uo pipefail
: "${OUT:?set OUT}"
dir=$OUT/multigpu
mkdir -p "$dir"
smoke=0
[[ "${1:-}" == --smoke ]] && smoke=1
if ! python3 -c "import deepspeed, hydra" 2>/dev/null; then  # no prelude ran: install the wheels carried in .whl
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
if (( smoke )); then
  limit=${LIMIT:-1800}
  echo "cpu smoke" > "$dir/gpu.txt"
else
  limit=${LIMIT:-450}
  # NVLink multicast stays off (the machine kind's rule: it can take the host's GPUs out of service).
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  export TORCH_CUDA_ARCH_LIST=9.0 CSA2_KERNEL_POISON=0
  nvidia-smi --query-gpu=index,name,memory.used,memory.total,driver_version,clocks.max.sm --format=csv \
    | tee "$dir/gpu.txt"
  nvidia-smi topo -m > "$dir/topology.txt" 2>&1
fi
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$dir/gpu.txt"
# The full output goes to the log; the console leaves out warnings (the JSON carries the results).
timeout "$limit" python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/multigpu.py \
  --out-dir "$dir" "$@" 2>&1 | tee "$dir/multigpu.log" | grep -v -i "warn"
rc=${PIPESTATUS[0]}
echo "exit $rc" | tee -a "$dir/multigpu.log"
ls -l "$dir"
exit "$rc"
