"""Every rank checks in before a collective save or load (`check_in`), so that a rank that never comes is named
instead of the others hanging in the save's collectives."""

from __future__ import annotations

import os
from pathlib import Path

from disttrain.checkpoint.errors import ArrivalError

CALLS: dict[str, int] = {}
"""Collective calls (save, load) so far per folder, in this process: every rank counts the same, also across the
managers a caller creates for one folder (the TrainingService's workers make one per command)."""
TIDIED: dict[str, int] = {}
"""Per folder, the check-ins whose keys this process has deleted from the store (all up to this one)."""


def check_in(directory: Path, rank: int, world_size: int, what: str, timeout_s: float) -> None:
    """Every rank checks in before a collective save or load, through the process group's store; a rank whose
    peers do not come within `timeout_s` (checkpoint.arrival_timeout_s) raises, naming them, instead of hanging in
    a collective.

    The outcome is settled once, in the store (compare-and-set: the first rank to decide writes it), and every
    rank follows it: a rank that comes after another gave up on it raises too, instead of going on alone into
    the save's collectives; and a rank that timed out just as the last one came goes on with the others."""
    # the folder as the job names it, the same string on every rank: not resolved, which on nodes that mount the
    # shared storage at other paths (or through other links) would give each its own keys, and a timeout
    folder = os.path.normpath(str(directory))
    calls = CALLS[folder] = CALLS.get(folder, 0) + 1
    from datetime import timedelta

    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    prefix = f"disttrain/ckpt_arrive/{folder}/{calls}"
    store.set(f"{prefix}/{rank}", what)
    keys = [f"{prefix}/{r}" for r in range(world_size)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
        missing = ""
    except Exception:  # DistStoreError (a timeout) in recent torch, RuntimeError in older ones
        missing = ",".join(str(r) for r, key in enumerate(keys) if not store.check([key]))
    proposal = f"{rank}:{missing}" if missing else "go"  # (the last came just after the timeout: go)
    outcome = store.compare_set(f"{prefix}/outcome", "", proposal).decode()
    if outcome == "go":  # every rank is past the earlier check-ins, where none reads their keys any more
        for earlier in range(TIDIED.get(folder, 0) + 1, calls):  # (one, unless one failed)
            store.delete_key(f"disttrain/ckpt_arrive/{folder}/{earlier}/{rank}")
            if rank == 0:
                store.delete_key(f"disttrain/ckpt_arrive/{folder}/{earlier}/outcome")
        TIDIED[folder] = calls - 1  # (the store keeps one check-in per folder)
        return
    waiter, missing = outcome.split(":")
    if rank in map(int, missing.split(",")):
        raise ArrivalError(
            f"CheckpointManager.{what} is collective: rank {rank} came to it after rank {waiter} had "
            f"waited checkpoint.arrival_timeout_s = {timeout_s:g} s for it and given up; "
            "every rank stops here. If this rank is only slow to come (a slow tracker, a long evaluation on "
            "this rank), raise checkpoint.arrival_timeout_s")
    raise ArrivalError(
        f"CheckpointManager.{what} is collective: rank {waiter} waited {timeout_s:g} s "
        f"for rank(s) {missing.replace(',', ', ')}, which did not call it in that time; call it on every "
        "rank (not under `if rank == 0`: rank 0 writes the manifest by itself), or, if a rank is only slow "
        "to come (a slow tracker on rank 0), raise checkpoint.arrival_timeout_s")
