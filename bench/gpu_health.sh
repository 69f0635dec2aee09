#!/usr/bin/env bash
# Training health on the GPU machine (issue 11), results under $OUT. Run from the repo root with the carried
# wheels (.whl: ../shared/gpu/fetch-wheels.sh .whl). Two GPUs: the two jobs run side by side; one: in turn.
#   bash bench/gpu_health.sh probe   # bench/init_health.py (init recipes) + a 40-step run of one candidate
#   bash bench/gpu_health.sh demo    # start the >= 300-step 16K runs, CSA2 (small, v41) and the dense-attention
#                                    # model, detached; wait up to WAIT seconds (default 560); copy what exists
#   bash bench/gpu_health.sh collect # a later call on the same machine: wait for them to end, copy the results
#   CSA2_CODE=<commit> bash bench/gpu_health.sh moe  # issue 34: `model=small_moe` at 16K in one call (below)
#   SMOKE=1 bash bench/gpu_health.sh moe             # the same on the CPU: v41_mini at 256 tokens, 8 steps
#   CSA2_CODE=<commit> bash bench/gpu_health.sh moe_start    # the same run detached (the call returns at once)
#   bash bench/gpu_health.sh moe_collect                     # later calls: wait up to WAIT (default 540) for it;
#                                    # copy what it has written so far (metrics, expert loads, the log's tail: a run
#                                    # the device budget cuts still brings its rows back), and the plots and
#                                    # verdicts once it has ended
# moe: one run in the foreground, cut at WAIT seconds (default 470; SIGTERM: the trainer stops after its step and
# writes its plots), of STEPS (default 100) steps warming up over WARMUP (40) to LR (3e-4, as the `small` demo),
# with the overrides in EXTRA (e.g. EXTRA="train.optimizer=muon train.log_every=5"), the held-out loss every EVERY
# (10) steps; then bench/health_criteria.py (init gradient norms against the head's, the warm-up's held-out losses,
# train.observe.health's criteria after it) into $OUT/small_moe/criteria.json and python -m train.routing_criteria's
# verdict into small_moe/routing_criteria.txt. Timing: ~90 s of start (wheels, build, first Triton compile), then
# 2.2 s a step with Muon and a row every 5 steps (H100, code 41b6e5a: bench/results/health/small_moe_16k_muon;
# AdamW with a row every step, older code, H200: ~3 s; with a 32K BPE head 3.1 s of wall time a step, evaluations and
# compiles included: bench/results/health/small_moe_16k_muon_bpe), so 500 steps need 1,200-1,600 s: moe_start, then
# moe_collect in the next calls while the machine is warm. Files: gpu.txt and small_moe/
# {metrics.jsonl, experts.jsonl, health.png, loss_curve.png, experts.png, routing.png, tail.log, criteria.json,
# routing_criteria.txt}.
set -uo pipefail
mode=${1:?probe, demo, collect, moe, moe_start or moe_collect}
: "${OUT:?set OUT}"
SMOKE=${SMOKE:-0}
if [ "$SMOKE" = 1 ]; then  # this machine's own packages
  export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
elif [ "$mode" = moe_collect ]; then  # the running job's packages: not reinstalled under it
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
elif ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
else
  echo "error: no wheels in .whl (../shared/gpu/fetch-wheels.sh .whl, and carry .whl)" >&2
  exit 1
fi
mkdir -p "$OUT"
if [ "$SMOKE" = 1 ]; then
  gpus=0
else
  nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
  gpus=$(nvidia-smi -L | wc -l)
fi
second=$(( gpus > 1 ? 1 : 0 ))

COMMON=(data.seq_len=16384 data.micro_batch_size=1 parallel.recompute=layer train.checkpoint_every=0
        train.eval.batches=2 train.eval.probe_examples=0 logger.mode=disabled train.progress=false)
DEMO=(train.max_steps=${STEPS:-300} train.warmup_steps=${WARMUP:-50} train.lr=${LR:-3e-4} train.eval.every=100)

train_run() {  # name gpu overrides...: python -m train into /tmp/<name>; its exit status in /tmp/<name>.done
  local name=$1 gpu=$2; shift 2
  CUDA_VISIBLE_DEVICES=$gpu python3 -m train "${COMMON[@]}" "$@" hydra.run.dir=/tmp/$name > /tmp/$name.log 2>&1
  echo $? > /tmp/$name.done
}

copy_results() {  # the run directories' files worth keeping, and the tail of each log
  for name in "$@"; do
    mkdir -p "$OUT/$name"
    cp /tmp/$name/{metrics.jsonl,health.png,loss_curve.png} "$OUT/$name/" 2>/dev/null
    grep -v -i warn /tmp/$name.log | tail -n 40 > "$OUT/$name/tail.log"
    [ -f /tmp/$name.done ] && echo "exit $(cat /tmp/$name.done)" >> "$OUT/$name/tail.log"
  done
}

wait_for() {  # seconds names...: until every named run has ended or the seconds have passed
  local until=$(( SECONDS + $1 )); shift
  while [ $SECONDS -lt $until ]; do
    local all=1
    for name in "$@"; do [ -f /tmp/$name.done ] || all=0; done
    [ $all = 1 ] && return 0
    sleep 5
  done
}

case $mode in
  probe)
    train_run short_embed1 "$second" model=small layout=v41 train.max_steps=40 train.warmup_steps=20 train.lr=3e-4 \
      model.embed_init_std=1.0 model.init_std=0.02 model.head_init_std=0.02 &
    [ "$gpus" -gt 1 ] || wait
    CUDA_VISIBLE_DEVICES=0 python3 bench/init_health.py --variants "${VARIANTS:-before,embed1,std006,embed1_std006}" \
      --out "$OUT/init_health.json" 2>&1 | grep -v Warning | tee "$OUT/init_health.log"
    wait
    copy_results short_embed1
    ;;
  demo)
    setsid nohup bash -c "$(declare -p COMMON); $(declare -f train_run); \
      train_run csa2 0 model=small layout=v41 ${DEMO[*]}" > /dev/null 2>&1 &
    setsid nohup bash -c "$(declare -p COMMON); $(declare -f train_run); \
      $( [ "$gpus" -gt 1 ] || echo 'while [ ! -f /tmp/csa2.done ]; do sleep 5; done;' ) \
      train_run dense $second model=small layout=window_only model.attention=dense ${DEMO[*]}" > /dev/null 2>&1 &
    wait_for "${WAIT:-560}" csa2 dense
    copy_results csa2 dense
    ;;
  collect)
    wait_for "${WAIT:-580}" csa2 dense
    copy_results csa2 dense
    ;;
  moe_start)  # the run's own OUT is on this machine: a later call's $OUT is another folder
    rm -rf /tmp/small_moe_call.done /tmp/small_moe_out
    setsid nohup bash -c "OUT=/tmp/small_moe_out bash '$0' moe; echo \$? > /tmp/small_moe_call.done" \
      > /tmp/small_moe_call.log 2>&1 < /dev/null &
    exit 0
    ;;
  moe_collect)
    wait_for "${WAIT:-540}" small_moe_call
    mkdir -p "$OUT/small_moe"
    cp /tmp/small_moe/{metrics.jsonl,experts.jsonl} "$OUT/small_moe/" 2>/dev/null
    grep -v -i warn /tmp/small_moe.log | tail -n 40 > "$OUT/small_moe/tail.log"
    [ -f /tmp/small_moe_call.done ] && cp -r /tmp/small_moe_out/small_moe/. "$OUT/small_moe/"
    ;;
  moe)
    if [ "$SMOKE" = 1 ]; then
      RUN=(model=v41_mini layout=v41_scaled data.seq_len=256 train.device=cpu train.precision=fp32)
      STEPS=${STEPS:-8} WARMUP=${WARMUP:-4} EVERY=${EVERY:-2}
    else
      [ -n "${CSA2_CODE:-}" ] || { echo "error: set CSA2_CODE=<commit> to label criteria.json" >&2; exit 2; }
      RUN=(model=small_moe layout=v41)
      STEPS=${STEPS:-100} WARMUP=${WARMUP:-40} EVERY=${EVERY:-10}
    fi
    rm -rf /tmp/small_moe /tmp/small_moe.done
    CUDA_VISIBLE_DEVICES=0 timeout --kill-after=60 "${WAIT:-470}" python3 -m train "${COMMON[@]}" "${RUN[@]}" \
      train.max_steps="$STEPS" train.warmup_steps="$WARMUP" train.lr="${LR:-3e-4}" train.eval.every="$EVERY" \
      ${EXTRA:-} hydra.run.dir=/tmp/small_moe > /tmp/small_moe.log 2>&1
    echo $? > /tmp/small_moe.done
    copy_results small_moe
    cp /tmp/small_moe/{experts.jsonl,experts.png,routing.png} "$OUT/small_moe/" 2>/dev/null
    python3 bench/health_criteria.py /tmp/small_moe --warmup "$WARMUP" --out "$OUT/small_moe/criteria.json" 2>&1 \
      | grep -v -i warn
    python3 -m train.routing_criteria /tmp/small_moe 2>&1 | grep -v -i warn | tee "$OUT/small_moe/routing_criteria.txt"
    ;;
esac
for f in "$OUT"/*/tail.log; do echo "== $f"; tail -n 4 "$f"; done
