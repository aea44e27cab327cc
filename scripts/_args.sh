# Shared by the train_dist_*.sh scripts: named arguments, usage text on bad ones (exit 2). Sourced, not run.
NUM_GPUS=1 NUM_NODES=1 NODE_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 CONFIG="" EXTRA=()
PYTHON=${PYTHON:-python3}

usage() {
  cat >&2 <<USAGE
usage: $(basename "$0") --num_gpus N [--num_nodes M] [--node_rank R] [--master_addr HOST] [--master_port PORT]
                        [--config FILE] [-- --set section.key=value ...]
  --num_gpus     processes on this node (one per GPU; on a CPU machine, processes)      default 1
  --num_nodes    nodes in the job                                                       default 1
  --node_rank    this node's rank, 0 .. num_nodes-1                                     default 0
  --master_addr  node 0's address, the same on every node                               default 127.0.0.1
  --master_port  a free port on node 0, the same on every node                          default 29500
  --config       a disttrain config (TOML, YAML or JSON)                                default: the built-in job
  after --        passed to disttrain (e.g. --set train.steps=100)
USAGE
  exit 2
}

bad() { echo "$(basename "$0"): $1" >&2; usage; }

is_count() { [[ "$1" =~ ^[0-9]+$ ]] && (( $1 >= ${2:-1} )); }

while (( $# )); do
  case "$1" in
    --num_gpus|--num_nodes|--node_rank|--master_addr|--master_port|--config)
      (( $# >= 2 )) || bad "$1 needs a value"
      case "$1" in
        --num_gpus) NUM_GPUS=$2 ;; --num_nodes) NUM_NODES=$2 ;; --node_rank) NODE_RANK=$2 ;;
        --master_addr) MASTER_ADDR=$2 ;; --master_port) MASTER_PORT=$2 ;; --config) CONFIG=$2 ;;
      esac
      shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    -h|--help) usage ;;
    *) bad "unknown argument '$1'" ;;
  esac
done
is_count "$NUM_GPUS" || bad "--num_gpus '$NUM_GPUS' is not a number >= 1"
is_count "$NUM_NODES" || bad "--num_nodes '$NUM_NODES' is not a number >= 1"
is_count "$NODE_RANK" 0 && (( NODE_RANK < NUM_NODES )) || bad "--node_rank '$NODE_RANK' must be 0 .. $((NUM_NODES - 1))"
is_count "$MASTER_PORT" && (( MASTER_PORT < 65536 )) || bad "--master_port '$MASTER_PORT' is not a port"
[[ -z "$CONFIG" || -f "$CONFIG" ]] || bad "--config '$CONFIG' does not exist"
CONFIG_ARGS=()
[[ -n "$CONFIG" ]] && CONFIG_ARGS=("$CONFIG")
