#!/usr/bin/env bash
# One node, N processes, through torchrun directly (what `disttrain train --nproc N` runs for you).
# Usage: scripts/train_torchrun.sh [NPROC] [CONFIG.toml] [--set section.key=value ...]
set -euo pipefail
NPROC=${1:-2}; shift || true
exec torchrun --nnodes 1 --nproc-per-node "$NPROC" --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:0 \
  --local-addr 127.0.0.1 -m disttrain.run "$@"
