#!/usr/bin/env bash
# Training health on the GPU machine (issue 11), results under $OUT. Run from the repo root with the carried
# wheels (.whl: ../shared/gpu/fetch-wheels.sh .whl). Two GPUs: the two jobs run side by side; one: in turn.
#   bash bench/gpu_health.sh probe   # bench/init_health.py (init recipes) + a 40-step run of one candidate
#   bash bench/gpu_health.sh demo    # start the >= 300-step 16K runs, CSA2 (small, v41) and the dense-attention
#                                    # model, detached; wait up to WAIT seconds (default 560); copy what exists
#   bash bench/gpu_health.sh collect # a later call on the same machine: wait for them to end, copy the results
set -uo pipefail
mode=${1:?probe, demo or collect}
: "${OUT:?set OUT}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
gpus=$(nvidia-smi -L | wc -l)
second=$(( gpus > 1 ? 1 : 0 ))

COMMON=(model=small data.seq_len=16384 data.micro_batch_size=1 parallel.recompute=layer train.checkpoint_every=0
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
    train_run short_embed1 "$second" layout=v41 train.max_steps=40 train.warmup_steps=20 train.lr=3e-4 \
      model.embed_init_std=1.0 model.init_std=0.02 model.head_init_std=0.02 &
    [ "$gpus" -gt 1 ] || wait
    CUDA_VISIBLE_DEVICES=0 python3 bench/init_health.py --variants "${VARIANTS:-before,embed1,std006,embed1_std006}" \
      --out "$OUT/init_health.json" 2>&1 | grep -v Warning | tee "$OUT/init_health.log"
    wait
    copy_results short_embed1
    ;;
  demo)
    setsid nohup bash -c "$(declare -p COMMON); $(declare -f train_run); \
      train_run csa2 0 layout=v41 ${DEMO[*]}" > /dev/null 2>&1 &
    setsid nohup bash -c "$(declare -p COMMON); $(declare -f train_run); \
      $( [ "$gpus" -gt 1 ] || echo 'while [ ! -f /tmp/csa2.done ]; do sleep 5; done;' ) \
      train_run dense $second layout=window_only model.attention=dense ${DEMO[*]}" > /dev/null 2>&1 &
    wait_for "${WAIT:-560}" csa2 dense
    copy_results csa2 dense
    ;;
  collect)
    wait_for "${WAIT:-580}" csa2 dense
    copy_results csa2 dense
    ;;
esac
for f in "$OUT"/*/tail.log; do echo "== $f"; tail -n 4 "$f"; done
