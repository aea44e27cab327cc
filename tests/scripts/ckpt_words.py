"""The CheckpointManager in the words of ../shared/seeds/004 on 2 ranks under FSDP2 (run by `disttrain launch`):

    python ckpt_words.py DIR OUT.json

save_checkpoint with is_best, rotation that keeps the best, load_latest_checkpoint / load_best_checkpoint into a
fresh sharded model and optimizer, and the manager called by rank 0 alone (it must fail fast, not hang)."""

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.distributed_c10d import _get_default_store
from torch.distributed.fsdp import fully_shard

from disttrain.checkpoint import CheckpointError, CheckpointManager, arrival
from disttrain.config import CheckpointConfig, DistConfig
from disttrain.runtime import exit_process, init_runtime, shutdown


def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    for layer in (model[0], model[2], model):
        fully_shard(layer)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def full(model) -> dict[str, list]:
    return {n: p.full_tensor().flatten().tolist() for n, p in model.named_parameters()}


def slow_storage(seconds: float) -> None:
    """This rank's writes of a full state take `seconds` longer (a large model on slow storage)."""
    import disttrain.checkpoint.manager as manager

    write_state = manager.write_state

    def slow(directory, name, state):
        if name == "state":
            time.sleep(seconds)
        return write_state(directory, name, state)
    manager.write_state = slow


def full_disk():
    """This rank's next writes of its own state fail as on a full disk; returns the undo."""
    import errno

    import disttrain.checkpoint.manager as manager

    write_state = manager.write_state

    def full(directory, name, state):
        if name.startswith("rank"):
            raise OSError(errno.ENOSPC, "No space left on device", str(directory / f"{name}.safetensors"))
        return write_state(directory, name, state)
    manager.write_state = full
    return lambda: setattr(manager, "write_state", write_state)


def main() -> None:
    folder, out = Path(sys.argv[1]), Path(sys.argv[2])
    runtime = init_runtime(DistConfig(threads_per_rank=1), always_form_group=True)
    manager = CheckpointManager(folder, CheckpointConfig(keep_last=2), runtime)
    model, optimizer = build()
    result = {"empty": manager.load_latest_checkpoint(model, optimizer)}
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(runtime.rank))
    saved = {}
    for step, eval_loss in enumerate([3.0, 1.0, 2.0, 2.5, 2.2], start=1):
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        manager.save_checkpoint(model, step, optimizer, metrics={"eval_loss": eval_loss}, is_best=step == 2)
        saved[step] = full(model)
    result["kept"] = manager.list()
    fresh, fresh_opt = build()
    latest = manager.load_latest_checkpoint(fresh, fresh_opt)
    result["latest"] = {"step": latest["step"], "equal": full(fresh) == saved[5],
                        "moments": len(fresh_opt.state) == len(list(fresh.parameters()))}
    best = manager.load_best_checkpoint(fresh)
    result["best"] = {"step": best["step"], "equal": full(fresh) == saved[2]}
    dist.barrier()  # the check-ins' keys in the store: those of the last one only (each earlier one deleted)
    prefix = f"disttrain/ckpt_arrive/{os.path.normpath(str(folder))}"
    calls = arrival.CALLS[os.path.normpath(str(folder))]
    result["check_ins"] = [k for k in range(1, calls + 1) if any(_get_default_store().check([f"{prefix}/{k}/{key}"])
                                                                for key in [*range(runtime.world_size), "outcome"])]
    result["calls"] = calls
    # rank 0 still writing a slow full-layout state when the next save and a load come: the others wait for it, and
    # arrival_timeout_s bounds only the check-in of a rank that never calls
    slow = CheckpointManager(folder / "slow", CheckpointConfig(async_save=True, arrival_timeout_s=1.5), runtime)
    if runtime.rank == 0:
        slow_storage(seconds=3)
    try:
        slow.save(1, {"w": torch.arange(4.0)})
        slow.save(2, {"w": torch.arange(4.0) + 1})
        result[f"slow{runtime.rank}"] = slow.load()["w"].tolist()
    except CheckpointError as exc:
        result[f"slow{runtime.rank}"] = str(exc)
    (out.parent / f"slow{runtime.rank}.json").write_text(json.dumps(result[f"slow{runtime.rank}"]))
    # rank 1's disk is full: DCP's collective write is entered by every rank or by none, so both ranks fail the save
    # at once (no hang in mismatched collectives), it is not committed, and the checkpoint before it stays
    for mode in ("sync", "async"):
        disk = CheckpointManager(folder / f"full_{mode}", CheckpointConfig(async_save=mode == "async"), runtime)
        disk.save_checkpoint(model, 1, optimizer)
        restore = full_disk() if runtime.rank == 1 else (lambda: None)
        try:
            disk.save_checkpoint(model, 2, optimizer)
            outcome = "saved"
        except CheckpointError as exc:
            outcome = str(exc)
        finally:
            restore()
        (out.parent / f"full_{mode}{runtime.rank}.json").write_text(json.dumps({"outcome": outcome,
                                                                              "kept": disk.list()}))
    # what rank 0 alone does fails on every rank: creating the step's folder (a file in its place), and committing
    # (a folder where `latest` goes); before, rank 0 raised and rank 1 went on into the next collective
    for what in ("folder", "commit", "commit_async"):  # (async: rank 0's commit fails in its background thread)
        blocked = CheckpointManager(folder / f"blocked_{what}", CheckpointConfig(async_save=what == "commit_async"),
                                    runtime)
        if runtime.rank == 0:
            (folder / f"blocked_{what}").mkdir()
            if what == "folder":
                (folder / "blocked_folder" / "step_1").write_text("not a folder")
            else:
                (folder / f"blocked_{what}" / "latest").mkdir()
                (folder / f"blocked_{what}" / "latest" / "keep").write_text("")
        dist.barrier()
        try:
            blocked.save_checkpoint(model, 1, optimizer)
            outcome = "saved"
        except CheckpointError as exc:
            outcome = str(exc)
        (out.parent / f"blocked_{what}{runtime.rank}.json").write_text(json.dumps({"outcome": outcome,
                                                                                 "kept": blocked.list()}))
    # rank 1 comes to a save after rank 0 gave up waiting for it: the outcome is settled once, so rank 1 stops too,
    # instead of going on alone into the save's collectives
    late = CheckpointManager(folder / "late", CheckpointConfig(arrival_timeout_s=1), runtime)
    late.save_checkpoint(model, 1, optimizer)
    dist.barrier()
    if runtime.rank == 1:
        time.sleep(2.5)
    try:
        late.save_checkpoint(model, 2, optimizer)
        outcome = "saved"
    except CheckpointError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    kept = late.list()
    dist.barrier()  # the caller caught it on every rank and saves again: the store then drops both check-ins before
    late.save_checkpoint(model, 3, optimizer)
    prefix = f"disttrain/ckpt_arrive/{os.path.normpath(str(folder / 'late'))}"
    stored = [k for k in (1, 2, 3) if any(_get_default_store().check([f"{prefix}/{k}/{key}"])
                                          for key in [*range(runtime.world_size), "outcome"])]
    (out.parent / f"late{runtime.rank}.json").write_text(json.dumps({"outcome": outcome, "kept": kept,
                                                                     "check_ins": stored}))
    dist.barrier()
    # the manager called under `if rank == 0`: rank 0 stops with a message, rank 1 is never blocked
    lonely = CheckpointManager(folder / "lonely", CheckpointConfig(arrival_timeout_s=3), runtime)
    if runtime.rank == 0:
        start = time.monotonic()
        try:
            lonely.save_checkpoint(model, 1)
            result["lonely"] = "saved"
        except CheckpointError as exc:
            result["lonely"] = str(exc)
        result["lonely_s"] = time.monotonic() - start
    dist.barrier()
    if runtime.rank == 0:
        out.write_text(json.dumps(result))
    del model, optimizer, fresh, fresh_opt
    shutdown(runtime)
    exit_process(0)  # (gloo's threads abort a normal interpreter exit now and then: runtime.exit_process)


if __name__ == "__main__":
    main()
