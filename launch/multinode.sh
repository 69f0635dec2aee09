#!/usr/bin/env bash
# Several nodes with the deepspeed launcher and a hostfile (one line per node: "<host> slots=<gpus>"; the nodes
# reach each other by passwordless ssh). Pipeline stages and data parallelism split the whole world:
#   HOSTFILE=hosts launch/multinode.sh parallel.pipeline_stages=4 data.seq_len=65536 model=small layout=v41
set -euo pipefail
cd "$(dirname "$0")/.."
exec deepspeed --hostfile "${HOSTFILE:?set HOSTFILE to a deepspeed hostfile}" --module train "$@"
