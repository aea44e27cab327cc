#!/usr/bin/env bash
# Several nodes through disttrain's launcher (watchdog, failure summary, restarts, a rendezvous that cannot complete
# named within dist.startup_timeout_s): run on every node with the same --num_nodes, --master_addr (node 0's
# address) and --master_port, each with its --node_rank. Checkpoints and status files need storage every node sees.
#   scripts/train_multinode.sh --num_nodes 2 --node_rank 0 --master_addr 10.0.0.1 --master_port 29400 \
#       --num_gpus 8 --config job.yaml [-- --max-restarts 3]
set -euo pipefail
source "$(dirname "$0")/_args.sh"
DISTTRAIN=${DISTTRAIN:-disttrain}
exec $DISTTRAIN train "${CONFIG_ARGS[@]}" --nproc "$NUM_GPUS" --nnodes "$NUM_NODES" --node-rank "$NODE_RANK" \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" --rdzv-id "disttrain-$MASTER_PORT" "${EXTRA[@]}"
