#!/usr/bin/env bash
# Which of the first AdamW updates collapses small_moe's routing (issue 54)? bench/routing_probe.py on one GPU,
# `model=small_moe layout=v41` at 16K tokens of random bytes (what the step benchmarks fed when the collapse was
# seen) and of stdlib text, at initialisation and after each of 3 steps of the trainer's schedule, with one group of
# parameters left untouched per stage. One JSON per stage under $OUT, the most decisive first, each rewritten after
# every measurement so a cut stage keeps what it measured.
#   CSA2_CODE=<commit> OUT=<dir> bash bench/gpu_routing.sh   # from the repository root; BUDGET seconds (default 540)
#   SMOKE=1 OUT=<dir> bash bench/gpu_routing.sh              # the same stages on the CPU: v41_mini, 64 tokens
#   ONLY="all gate_frozen" OUT=<dir> bash bench/gpu_routing.sh
# Stages (file under $OUT -> bench/results/routing/):
#   all            routing_all.json: every parameter trained (the collapse as the step benchmarks saw it)
#   gate_frozen    routing_gate_frozen.json: the gate's weights untouched: does the gate's sign step cause it?
#   writers_frozen routing_writers_frozen.json: what writes the stream untouched (attention output, FFN and expert
#                  matrices, hyper-connection mixes): does a shift shared by all tokens, growing with depth, cause it?
#   gate_only      routing_gate_only.json: only the gate trains: is the gate's update alone enough?
#   long_warmup    routing_long_warmup.json: everything trains at train.warmup_steps=2000 (lr 1.5e-6, 3e-6, 4.5e-6
#                  instead of 1.5e-4, 3e-4, 4.5e-4): does a small first lr keep routing healthy?
# The GPU, each stage's exit code and seconds, and the stage logs in logs.txt (6 files in all).
# Each stage runs under `timeout`, capped by what is left of BUDGET (bench/gpu_stages.sh). CSA2_CODE=<commit>
# (required on the GPU) labels the result files.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_stages.sh
SMOKE=${SMOKE:-0}

if [ "$SMOKE" = 1 ]; then  # the CPU: v41_mini at 64 tokens, fp32; limits x 4
  SCALE=4
  MODEL=(--device cpu --tokens 64 model=v41_mini layout=v41_scaled)
else
  SCALE=1
  MODEL=(--tokens "${SEQ:-16384}" model=small_moe layout=v41)
fi
stages_begin 540
export CSA2_KERNEL_POISON=0

PROBE=(python3 bench/routing_probe.py --steps 3 --data random,text "${MODEL[@]}")
WRITERS=attn_out,ffn,experts,hc
ALL_BUT_GATE=embedding,attn_q,attn_kv,indexer,attn_out,ffn,experts,hc,engram,norms_sinks,head
stage all 100 "${PROBE[@]}" --out "$OUT/routing_all.json"
stage gate_frozen 75 "${PROBE[@]}" --freeze gate --out "$OUT/routing_gate_frozen.json"
stage writers_frozen 75 "${PROBE[@]}" --freeze $WRITERS --out "$OUT/routing_writers_frozen.json"
stage gate_only 75 "${PROBE[@]}" --freeze $ALL_BUT_GATE --out "$OUT/routing_gate_only.json"
stage long_warmup 75 "${PROBE[@]}" train.warmup_steps=2000 --out "$OUT/routing_long_warmup.json"
rm -f "$OUT"/*.tmp  # a stage cut while rewriting its file: the last complete file stands (8 files come back)
stages_end
