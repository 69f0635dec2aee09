#!/usr/bin/env bash
# The V4.1 parts' speed on one H200 (issues 34, 51), every result as JSON under $OUT as soon as it exists, the most
# valuable first, so a cut call still brings back the earlier ones.
#   CSA2_CODE=<commit> OUT=<dir> bash bench/gpu_v41.sh      # from the repository root; BUDGET seconds (default 540)
#   SMOKE=1 OUT=<dir> bash bench/gpu_v41.sh                 # the same sequence on the CPU at tiny shapes
#   ONLY="slice slice_base" OUT=<dir> bash bench/gpu_v41.sh # only the named stages
#   SEQ=32768 ...                                           # rows of 32K tokens (default 64K)
#   BASE=<dir> BASE_CODE=<commit> ...                       # the *_base stages run the tree in <dir> (an older
#                                                           # commit's kernels/ model/ parallel/ train/ bench/ conf/,
#                                                           # e.g. `git archive <commit> ... | tar -x -C <dir>`):
#                                                           # the baseline measured in the same call
# Stages (file under $OUT -> bench/results/...):
#   check             check.json: every fused op of the stream and the MoE against the PyTorch reference in bf16
#                     (bench/bench_kernels.py check: check_hyper and the MoE sections)              -> kernels/
#   kernels           kernels_bench.json: the same ops timed against the PyTorch path (bench_hyper, bench_moe)
#   train_small_moe   train_step_small_moe_65536.json: `model=small_moe layout=v41` at 64K, the whole step: tokens/s,
#                     MFU against the matmul rate of the same process, peak memory, tokens per expert, time per part
#                     (attention, MoE, mHC, Engram; forward, recomputation, backward), device time by kernel -> train/
#   train_small_moe_base  the same step of the BASE tree (parts, no kernel table)    -> train/..._base.json
#   moe_ffn           moe_ffn.json: bench/moe_ffn.py, the routed path (gate, sort, permutation, grouped GEMMs, SwiGLU,
#                     combine) at V4.1 shapes against a dense GEMM chain of the same FLOPs               -> kernels/
#   slice             v41_slice.json: bench/v41_slice.py, layers 20-23 and 24-27 at V4.1 width, splits own_tokens
#                     and uniform, each run's device time by kernel                                  -> v41_slice/
#   slice_base        the same on the BASE tree                                      -> v41_slice/v41_slice_base.json
#   quant_gemm        quant_gemm.json: bench/quant_gemm.py, the frozen base's FP8/FP4 GEMMs, fused and through a
#                     transient copy, against bf16 at 128-1,024 rows a matrix (issue 56)
#                                                                                                    -> finetune/
#   quant_gemm_base   the same on the BASE tree                                   -> finetune/quant_gemm_base.json
#   quant_gemm_sweep  quant_gemm_sweep.json: the same with --sweep, the kernel at each launch shape of SWEEP
#                                                                                                    -> finetune/
#   train_small_moe_full, train_small_moe_lora  train_step_small_moe_{full,lora}_65536.json: the step (its timing
#                     and peak only) in full and with LoRA rank 16: the memory model's measured peaks  -> finetune/
#   lora_slice        lora_slice.json: bench/lora_slice.py, the one-node LoRA plan's GPU (1 x 8 x 8: 8,192 tokens,
#                     48 experts) on layers 20-23 and 24-27, rank 16, over the quantised base (FP8 / FP4, built and
#                     filled as a run does) then the bf16 base: step, peak, MFU, their ratios, the memory model's
#                     estimate of the same layers, device time by kernel (issue 56)                  -> finetune/
#   import_slice      import_slice.json: bench/import_slice.py, a V4.1-width stage of the released format written,
#                     then imported dequantised and held as stored: seconds, bytes, peaks (issues 36, 56) -> finetune/
# The GPU, each stage's exit code and seconds, and the stage logs in logs.txt (a device call returns at most 8 files:
# choose at most 7 result files' stages with ONLY).
# Each stage runs under `timeout`, capped by what is left of BUDGET (bench/gpu_stages.sh). CSA2_CODE=<commit>
# (required on the GPU) labels the result files (BASE_CODE the baseline's).
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_stages.sh
SMOKE=${SMOKE:-0}

if [ "$SMOKE" = 1 ]; then  # the CPU: v41_mini at 64 tokens, the PyTorch kernels, fp32; limits x 4
  SCALE=4
  MOE=(--device cpu model=v41_mini layout=v41_scaled data.seq_len=64 train.precision=fp32)
  FFN=(--smoke)
  SLICE=(--smoke)
  LORA=(--smoke)
  KB=(python3 bench/bench_kernels.py --smoke)
  T=64
else
  SCALE=1
  T=${SEQ:-65536}  # tokens of the row (SEQ=32768 fits an H100's 78 GiB)
  MOE=(model=small_moe layout=v41 data.seq_len=$T)
  FFN=()
  SLICE=(--splits own_tokens,uniform --modes layer --tokens $T)
  LORA=(--tokens $((T / 8)))  # a GPU's context chunk of the row (C = 8)
  KB=(python3 bench/bench_kernels.py)
fi
stages_begin 540
export CSA2_KERNEL_POISON=0

BASE_RUN=(false)  # a command prefix: run in the BASE tree, its results labelled BASE_CODE
if [ -n "${BASE:-}" ]; then
  BASE=$(cd "$BASE" && pwd)
  BASE_RUN=(env -C "$BASE" CSA2_CODE="${BASE_CODE:-base}" PYTHONPATH="$SITE$BASE")
fi

MOE_CHECKS=check_moe_swiglu,check_moe_permute,check_moe_cast,check_moe_gate,check_moe_layer
stage check 150 "${KB[@]}" check --only "check_hyper,$MOE_CHECKS" --out "$OUT/check.json"
stage kernels 90 "${KB[@]}" bench --only bench_hyper,bench_moe --out "$OUT/kernels_bench.json"
STEP=(python3 bench/train_step.py --variant csa2 --steps 2 --warmup 1)
stage train_small_moe 300 "${STEP[@]}" --kernel-table --out "$OUT/train_step_small_moe_$T.json" "${MOE[@]}"
stage train_small_moe_base 260 "${BASE_RUN[@]}" "${STEP[@]}" --out "$OUT/train_step_small_moe_${T}_base.json" "${MOE[@]}"
stage moe_ffn 100 python3 bench/moe_ffn.py "${FFN[@]}" --out "$OUT/moe_ffn.json"
stage slice 260 python3 bench/v41_slice.py "${SLICE[@]}" --kernel-table --out "$OUT/v41_slice.json"
stage slice_base 260 "${BASE_RUN[@]}" python3 bench/v41_slice.py "${SLICE[@]}" --out "$OUT/v41_slice_base.json"
stage quant_gemm 90 python3 bench/quant_gemm.py "${FFN[@]}" --out "$OUT/quant_gemm.json"
stage quant_gemm_sweep 150 python3 bench/quant_gemm.py "${FFN[@]}" --sweep --out "$OUT/quant_gemm_sweep.json"
stage quant_gemm_base 90 "${BASE_RUN[@]}" python3 bench/quant_gemm.py "${FFN[@]}" --out "$OUT/quant_gemm_base.json"
stage train_small_moe_full 150 "${STEP[@]}" --no-detail --out "$OUT/train_step_small_moe_full_$T.json" "${MOE[@]}"
stage train_small_moe_lora 150 "${STEP[@]}" --no-detail --out "$OUT/train_step_small_moe_lora_$T.json" "${MOE[@]}" \
  train.lora.rank=16 "train.lora.targets=[wq_a,wq_b,wkv,wo_a,wo_b,shared_experts,experts]"
stage lora_slice 200 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 bench/lora_slice.py "${LORA[@]}" \
  --kernel-table --out "$OUT/lora_slice.json"
stage import_slice 300 python3 bench/import_slice.py "${FFN[@]}" --out "$OUT/import_slice.json"
stages_end
