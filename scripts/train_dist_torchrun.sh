#!/usr/bin/env bash
# A disttrain job through torchrun directly (what `disttrain train --nproc N` runs for you), static rendezvous at
# --master_addr:--master_port. One node: scripts/train_dist_torchrun.sh --num_gpus 4 --config job.yaml
# Several nodes: the same command on every node with --num_nodes, --node_rank and node 0's --master_addr.
set -euo pipefail
source "$(dirname "$0")/_args.sh"
exec "$PYTHON" -m torch.distributed.run --nproc_per_node="$NUM_GPUS" --nnodes="$NUM_NODES" --node_rank="$NODE_RANK" \
  --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" -m disttrain.run "${CONFIG_ARGS[@]}" "${EXTRA[@]}"
