#!/usr/bin/env bash
# Several nodes: run this on every node with the same HOST:PORT (the first node's address and a free port).
# Usage: scripts/train_multinode.sh NNODES NODE_RANK HOST:PORT [NPROC_PER_NODE] [CONFIG.toml] [--set k=v ...]
#   NNODES may be MIN:MAX for elastic membership. Add --max-restarts K to survive rank failures
#   (each restart resumes from the newest committed checkpoint; checkpoints need a shared file system).
set -euo pipefail
NNODES=$1 NODE_RANK=$2 ENDPOINT=$3 NPROC=${4:-1}; shift 4 || shift $#
exec disttrain train "$@" --nnodes "$NNODES" --node-rank "$NODE_RANK" --rdzv-endpoint "$ENDPOINT" --nproc "$NPROC"
