#!/usr/bin/env bash
# One-off: the fused residual add + ffn_norm on the GPU: its bitwise check, then the 64K step with it and, in the
# same call, without it (model/transformer.py before the change: tmp_old_transformer.py).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
nvidia-smi --query-gpu=memory.used --format=csv,noheader
timeout 60 python3 bench/bench_kernels.py check --only check_norm_and_cast --out $OUT/check_addnorm.json > $OUT/log.txt 2>&1
echo "check rc=$? ${SECONDS}s"; grep -o '"add_norm_bitwise": {[^}]*}\|"pass": [a-z]*' $OUT/log.txt | head -3
timeout 150 python3 bench/train_step.py --variant csa2 --steps 2 --warmup 1 --no-detail \
  --out $OUT/train_step_csa2_65536_addnorm.json >> $OUT/log.txt 2>&1
echo "fused rc=$? ${SECONDS}s"
cp tmp_old_transformer.py model/transformer.py
timeout 130 python3 bench/train_step.py --variant csa2 --steps 2 --warmup 1 --no-detail \
  --out $OUT/train_step_csa2_65536_unfused.json >> $OUT/log.txt 2>&1
echo "unfused rc=$? ${SECONDS}s"
grep -h -o '"step_s": [0-9.]*\|"step_times_s": \[[^]]*\]\|"tokens_per_s": [0-9.]*' $OUT/train_step_csa2_65536_*.json
