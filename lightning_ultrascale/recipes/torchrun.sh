#!/usr/bin/env bash
# Launch a recipe with torchrun's elastic agent on one or more nodes (run this script on every node).
#   NNODES=2 MASTER_ADDR=node0 RUN_ID=llama8b-1 "$(ultrascale-train --recipes-dir)"/torchrun.sh \
#     recipe=llama3_8b data.source=/data/corpus.bin
# The c10d rendezvous (hosted by MASTER_ADDR's agent) lets any node start first. When a rank dies,
# the agents stop the whole worker group and start it again, up to MAX_RESTARTS times; every
# restarted rank resumes from the newest complete checkpoint of the run directory by itself
# (ckpt_path=auto). The job keeps its size: shrinking or growing it (--nnodes MIN:MAX) is not
# supported, a checkpoint of any layout loads, but the data's order is the world size's.
# Every node must be given the same RUN_ID: it is the rendezvous id and names the run directory.
set -euo pipefail
NNODES=${NNODES:-1}
NPROC_PER_NODE=${NPROC_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
MAX_RESTARTS=${MAX_RESTARTS:-3}
RUN_ID=${RUN_ID:-$(date +%Y%m%d-%H%M)}
export ULTRASCALE_RUN_DIR=${ULTRASCALE_RUN_DIR:-outputs/torchrun-$RUN_ID}
# A Python traceback of every thread on a fatal signal in the log; a NCCL error or timeout ends the rank.
export PYTHONFAULTHANDLER=1
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-3}
# NCCL's flight recorder: its last 2000 collectives per rank, dumped on a timeout into the run directory
# (<run dir>/flight_recorder/rank_<rank>); read them with `torchfrtrace <run dir>/flight_recorder -p rank_`.
export TORCH_NCCL_TRACE_BUFFER_SIZE=${TORCH_NCCL_TRACE_BUFFER_SIZE:-2000}
export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}
export TORCH_FR_DUMP_TEMP_FILE=${TORCH_FR_DUMP_TEMP_FILE:-$ULTRASCALE_RUN_DIR/flight_recorder/rank_}
mkdir -p "$(dirname "$TORCH_FR_DUMP_TEMP_FILE")"  # torch writes the files, not their directory
# A fresh store (hosted by rank 0) for every restarted worker group. The c10d rendezvous otherwise
# shares its own store with the workers, and it outlives a restart: a new rank can read a dead rank's
# address from the previous attempt before the new one is written (measured: "Gloo connectFullMesh
# failed ... Connection refused" on every restart, until --max-restarts ran out).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
exec torchrun \
  --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" \
  --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RUN_ID" \
  --max-restarts "$MAX_RESTARTS" \
  -m lightning_ultrascale.cli.train cluster=torchrun "$@"
