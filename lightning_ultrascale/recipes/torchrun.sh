#!/usr/bin/env bash
# Launch a recipe with torchrun on one or more nodes (run this script on every node).
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 "$(ultrascale-train --recipes-dir)"/torchrun.sh recipe=llama3_8b data.source=/data/corpus.bin
# Every rank must agree on the run directory: it is derived from RUN_ID, which every node must
# be given the same (the default, a date, is only safe on one node).
set -euo pipefail
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
NPROC_PER_NODE=${NPROC_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
RUN_ID=${RUN_ID:-$(date +%Y%m%d-%H%M)}
export ULTRASCALE_RUN_DIR=${ULTRASCALE_RUN_DIR:-outputs/torchrun-$RUN_ID}
exec torchrun \
  --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC_PER_NODE" \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
  -m lightning_ultrascale.cli.train cluster=torchrun "$@"
