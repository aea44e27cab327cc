"""A pickle planted in a committed DCP shard, its checksums forged: loading must refuse it and fall back.

    disttrain launch --nproc 2 planted_shard.py OUT_DIR   (two ranks; the pickle goes into rank 1's shard)

Step 1, 2 and 3 are saved; step 2 gets the pickle, step 3 a flipped byte in a shard file that only rank 1 hashes
when the ranks load together: both ranks must skip both, and load step 1.

Each rank writes OUT_DIR/rank<R>.json: the step it loaded, whether its parameters equal step 1's, and (rank
0) the checkpoint warnings. `fsdp_gpt`, `train_step` and `plant_pickle` are also used by test_checkpoint.py.
"""

import hashlib
import json
import logging
import os
import pickle
import sys
from pathlib import Path

import torch


class Marker:
    """Unpickling this would create a file: the proof that nothing unpickled it."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def fsdp_gpt(runtime):
    """A tiny GPT on the fsdp backend (sharded state: DTensors), always the same initial weights."""
    from disttrain.backend import create_backend
    from disttrain.config import ModelConfig, OptimConfig, ParallelConfig
    from disttrain.models.gpt import GPT
    from disttrain.optim import optimizer_factory

    torch.manual_seed(0)
    return create_backend(GPT(ModelConfig(n_layer=1, n_head=2, d_model=32, seq_len=8)),
                          optimizer_factory(OptimConfig()), ParallelConfig(strategy="fsdp"), runtime=runtime)


def train_step(backend) -> None:
    x = torch.randint(0, 256, (2, 9))
    backend.forward_backward({"input_ids": x[:, :-1], "labels": x[:, 1:]})
    backend.optim_step()


def plant_pickle(folder: Path, shard: str, marker: Path) -> None:
    """Write a pickle that would create `marker` at the start of every tensor DCP stored in `folder/shard`,
    then forge the manifest's size and sha256 for it and the commit marker, so every checksum matches."""
    evil = pickle.dumps(Marker(marker), protocol=2)  # the protocol torch.save writes: it reaches the GLOBAL
    data = bytearray((folder / shard).read_bytes())
    for entry in json.loads((folder / "metadata.json").read_text())["storage"]:
        if entry["path"] == shard:
            data[entry["file_offset"]:entry["file_offset"] + len(evil)] = evil
    (folder / shard).write_bytes(bytes(data))
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"][shard] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest_bytes = json.dumps(manifest, indent=1, sort_keys=True).encode()
    (folder / "manifest.json").write_bytes(manifest_bytes)
    (folder / "COMMITTED").write_text(hashlib.sha256(manifest_bytes).hexdigest())


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


class _Recorder(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def main() -> None:
    from disttrain.checkpoint import CheckpointManager
    from disttrain.config import DistConfig
    from disttrain.runtime import init_runtime, shutdown

    out = Path(sys.argv[1])
    runtime = init_runtime(DistConfig(device="cpu", threads_per_rank=1))
    recorder = _Recorder()
    logging.getLogger("disttrain.checkpoint").addHandler(recorder)
    backend = fsdp_gpt(runtime)
    manager = CheckpointManager(out / "checkpoints", runtime=runtime)
    train_step(backend)
    manager.save(1, backend.state_dict())
    step1 = [p.full_tensor().clone() for p in backend.model.parameters()]
    train_step(backend)
    manager.save(2, backend.state_dict())
    train_step(backend)
    manager.save(3, backend.state_dict())
    if runtime.rank == 0:
        plant_pickle(manager.path(2), "__1_0.distcp", out / "pwned")
        flip_a_byte(manager.path(3) / "__1_0.distcp")  # a file only rank 1 hashes (the ranks share DCP's files)
    runtime.barrier()

    restored = fsdp_gpt(runtime)
    loaded = manager.load(target=restored.prepared.checkpoint_target)
    restored.load_state_dict(loaded)
    same = all(torch.equal(p.full_tensor(), e) for p, e in zip(restored.model.parameters(), step1, strict=True))
    (out / f"rank{runtime.rank}.json").write_text(json.dumps(
        {"step": loaded["manifest"]["step"], "same_as_step1": same, "warnings": recorder.messages}))
    del backend, restored  # see runtime.shutdown: nothing holding the process group may outlive it
    shutdown(runtime)


if __name__ == "__main__":
    from disttrain.runtime import exit_process

    main()
    exit_process(0)
