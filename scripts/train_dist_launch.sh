#!/usr/bin/env bash
# The same through the legacy launcher, `python -m torch.distributed.launch` (deprecated by PyTorch in favour of
# torchrun; kept for clusters whose tooling still calls it). It passes the rank in the environment (--use-env), which
# is what disttrain reads. Usage as scripts/train_dist_torchrun.sh.
set -euo pipefail
source "$(dirname "$0")/_args.sh"
exec "$PYTHON" -W ignore::FutureWarning -m torch.distributed.launch --use-env --nproc_per_node="$NUM_GPUS" \
  --nnodes="$NUM_NODES" --node_rank="$NODE_RANK" --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" \
  -m disttrain.run "${CONFIG_ARGS[@]}" "${EXTRA[@]}"
