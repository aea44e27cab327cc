"""A toy inference engine: receives a TrainingService's weights (WeightReceiver) and answers forward calls with them.

    python toy_engine.py ENDPOINT NAME [--die-at-bucket K]

Commands arrive one JSON object per line on stdin, answers leave the same way on stdout:

    {"op": "receive", "timeout": S}      -> {"version": V} or {"error": "..."}
    {"op": "forward", "ids": [[...]]}    -> {"logits": [...]} from the GPT of service_job.MODEL with the weights held
    {"op": "save", "path": P}            -> {"saved": P}: the weights held, as safetensors

`--die-at-bucket K`: SIGKILL itself when the K-th bucket of a version arrives (a consumer dying mid-sync).
"""

import argparse
import json
import os
import signal
import sys

import torch
from safetensors.torch import save_file

from disttrain.config import ModelConfig
from disttrain.models.gpt import GPT
from disttrain.service.weights import WeightReceiver, WeightSyncError

sys.path.insert(0, os.path.dirname(__file__))
import service_job  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("endpoint")
    parser.add_argument("name")
    parser.add_argument("--die-at-bucket", type=int, default=0)
    parser.add_argument("--recycle-from", type=int, default=1 << 20, help="receive buffers recycled from this size")
    args = parser.parse_args()
    torch.set_num_threads(1)
    receiver = WeightReceiver(args.endpoint, args.name, recycle_from=args.recycle_from)
    model = GPT(ModelConfig(**service_job.MODEL)).eval()
    arrived = 0

    def on_bucket(rank, index):
        nonlocal arrived
        arrived += 1
        if args.die_at_bucket and arrived >= args.die_at_bucket:
            os.kill(os.getpid(), signal.SIGKILL)

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "receive":
            try:
                answer = {"version": receiver.receive(command.get("timeout"), on_bucket)}
                receiver.load_into(model)
            except WeightSyncError as exc:
                answer = {"error": str(exc), "version": receiver.version}
        elif command["op"] == "forward":
            with torch.no_grad():
                answer = {"logits": model(torch.tensor(command["ids"])).tolist()}
        else:
            save_file({k: v.clone() for k, v in receiver.weights.items()}, command["path"])  # (tied: one tensor)
            answer = {"saved": command["path"]}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
