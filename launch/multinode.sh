#!/usr/bin/env bash
# Several nodes with the deepspeed launcher and a hostfile (one line per node: "<host> slots=<gpus>"; the nodes
# reach each other by passwordless ssh). Pipeline stages and data parallelism split the whole world:
#   HOSTFILE=hosts launch/multinode.sh parallel.pipeline_stages=4 data.seq_len=65536 model=small layout=v41
# The run directory (RUN_DIR, default outputs/multinode-<start time>) must be on a filesystem every node shares; a
# failed job restarts up to MAX_RESTARTS times from its newest intact checkpoint (launch/restarts.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/restarts.sh
restarting deepspeed --hostfile "${HOSTFILE:?set HOSTFILE to a deepspeed hostfile}" --module train \
  hydra.run.dir="${RUN_DIR:-outputs/multinode-$(date +%Y-%m-%d_%H-%M-%S)}" train.resume=auto "$@"
