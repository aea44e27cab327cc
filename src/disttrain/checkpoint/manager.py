"""CheckpointManager: checkpoints that exist only once committed, verified before use, rotated safely.

On-disk layout: see layout.py.

Save protocol: every rank writes and fsyncs its files and a `files_rank<R>.json`; the ranks agree that all
writes succeeded (one small all-reduce); rank 0 writes the manifest, then the commit marker, then `latest`,
then rotates. A crash at any moment leaves at worst an uncommitted folder, which discovery ignores and the
next save removes. Loading scans for commit markers (it never trusts `latest` alone) and verifies every
file's size and sha256 before anything is deserialised; a bad checkpoint is skipped with a warning naming
the file, falling back to the previous committed one.

The manager is usable on its own: it needs a folder, a `CheckpointConfig`, and optionally a `Runtime`.
Sharded strategies will write their `state` with torch.distributed.checkpoint into the same folder; the
commit marker, manifest and checksums are the same.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from disttrain.checkpoint.arrival import check_in
from disttrain.checkpoint.catalog import Catalog
from disttrain.checkpoint.commit import commit, describe_os_error, remove_checkpoint, try_write
from disttrain.checkpoint.errors import ArrivalError, CheckpointError
from disttrain.checkpoint.layout import DCP_METADATA, read_checkpoint_files
from disttrain.checkpoint.sharded import is_sharded, merge_skeletons, read_sharded, write_dcp, write_skeleton
from disttrain.checkpoint.snapshot import Staging, restore_rng, rng_state
from disttrain.checkpoint.statefile import ChecksumError, atomic_write, flatten, read_state, write_state
from disttrain.collectives import gather_json
from disttrain.config import CheckpointConfig
from disttrain.runtime import Runtime, loopback_gloo

__all__ = ["ArrivalError", "CheckpointError", "CheckpointManager", "merge_skeletons", "restore_rng"]

log = logging.getLogger(__name__)


class CheckpointManager(Catalog):
    """save / load over one checkpoint folder, and what its `Catalog` tells (list / latest / best). See the module
    docstring."""

    def __init__(self, directory: str | Path, cfg: CheckpointConfig | None = None, runtime: Runtime | None = None,
                 info: dict[str, Any] | None = None, timeout_s: float = 600.0):
        super().__init__(directory, cfg)
        self.runtime = runtime
        self.timeout_s = timeout_s  # how long rank 0 waits for other ranks' background writes
        self.info = dict(info or {})  # recorded in every manifest: strategy, config hash, ...
        self._pending: threading.Thread | None = None
        self._staging = Staging()  # async saves copy into its buffers (reused: no page faults)
        self._dcp_group = None  # async sharded saves: DCP's collectives on a gloo group of their own (False: none
        # can reach every node, and sharded saves are synchronous)
        self._pending_error: BaseException | None = None
        self._copied: threading.Event | None = None  # set once an async save's snapshot is taken

    # -- facts -------------------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.runtime.rank if self.runtime else 0

    @property
    def world_size(self) -> int:
        return self.runtime.world_size if self.runtime else 1

    def _distributed(self) -> bool:
        return bool(self.runtime and self.runtime.distributed)

    def _arrive(self, what: str) -> None:
        """Every rank checks in before the collective `what` (arrival.py), or raises naming the ranks that did not."""
        if self._distributed():
            check_in(self.dir, self.rank, self.world_size, what, self.cfg.arrival_timeout_s)

    def _settle(self, what: str) -> None:
        """Check in for the collective `what` (`_arrive`), then `wait_all`. Checking in comes first: rank 0 may
        still be writing a whole full-layout state, longer than `arrival_timeout_s` for a large model, and the
        others wait for it in `wait_all`'s all-reduce, under the process group's timeout, instead of timing out on a
        rank that did call."""
        self._arrive(what)
        self.wait_all()

    def wait_all(self) -> None:
        """Every rank: wait for this rank's in-flight async save; if it failed on any rank, every rank raises
        (collective: one all-reduce), so that no rank goes on alone. `wait` is this rank's own."""
        error = None
        try:
            self.wait()
        except CheckpointError as exc:
            error = exc
        except BaseException as exc:  # (a gloo error, ...): a CheckpointError like the other ranks', whatever it was
            error = CheckpointError(f"the async checkpoint save in {self.dir} failed: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
        if self._any_rank_failed(error is not None, collective=True):
            raise error or CheckpointError(f"the previous async checkpoint save in {self.dir} failed on another "
                                           "rank (that rank's log says why)")

    # -- the design's words (../shared/seeds/004): thin methods over save / load --------------------

    def save_checkpoint(self, model: torch.nn.Module, step: int, optimizer=None, scheduler=None,
                        metrics: dict[str, Any] | None = None, is_best: bool = False) -> Path:
        """Save `model` (and `optimizer`, `scheduler`) as checkpoint `step`, on every rank; `is_best` marks it as
        the best so far (`load_best_checkpoint`; rotation keeps it). A sharded model (FSDP) saves its shards."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        state: dict[str, Any] = {"model": get_model_state_dict(model)}
        if optimizer is not None:
            state["optimizer"] = get_optimizer_state_dict(model, optimizer)
        if scheduler is not None:
            state["scheduler"] = scheduler.state_dict()
        metrics = dict(metrics or {})
        if is_best:
            metrics["is_best"] = True
        self.save(step, state, metrics)
        self.wait_all()  # (an async save's failure, e.g. rank 0's commit, is every rank's)
        return self.path(step)

    def load_latest_checkpoint(self, model: torch.nn.Module, optimizer=None, scheduler=None
                               ) -> dict[str, Any] | None:
        """Load the newest committed checkpoint that verifies into `model` (and `optimizer`, `scheduler`); its
        metadata (step, metrics, ...), or None when there is none. Every rank calls it."""
        return self._load_into("latest", model, optimizer, scheduler)

    def load_best_checkpoint(self, model: torch.nn.Module, optimizer=None, scheduler=None) -> dict[str, Any] | None:
        """Load the best checkpoint (the newest saved with `is_best=True`, else the best by `best_metric`) into
        `model`; its metadata, or None when there is none. Every rank calls it."""
        self._arrive("load_best_checkpoint")  # before the broadcast: a rank that does not call it is named
        best = -1
        if self.rank == 0:
            try:
                flagged = [s for s in self.list() if self.manifest(s).get("metrics", {}).get("is_best")]
                best = flagged[-1] if flagged else self.best()
                best = -1 if best is None else best
            except (OSError, ValueError, AttributeError):  # a damaged manifest: every rank raises below, alike
                best = -2
        best = self.rank0(best)
        if best == -2:
            raise CheckpointError(f"a manifest in {self.dir} could not be read; `disttrain ckpt verify {self.dir}` "
                                  "names it")
        return None if best < 0 else self._load_into(best, model, optimizer, scheduler)

    def _load_into(self, step, model, optimizer, scheduler) -> dict[str, Any] | None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        if step == "latest":
            self._arrive("load_latest_checkpoint")  # before the broadcast: a rank that does not call it is named
            if not self.has_checkpoint():
                return None  # (every rank together)
        from disttrain.parallel.state import dtensor_targets  # a sharded model: each rank reads its own shards

        state = self.load(step, target=dtensor_targets(model))
        set_model_state_dict(model, state["model"])
        if optimizer is not None and "optimizer" in state:
            set_optimizer_state_dict(model, optimizer, state["optimizer"])
        if scheduler is not None and "scheduler" in state:
            scheduler.load_state_dict(state["scheduler"])
        manifest = state["manifest"]
        return {"step": manifest["step"], "metrics": manifest.get("metrics", {}),
                "path": str(self.path(manifest["step"]))}

    # -- save --------------------------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any], metrics: dict[str, Any] | None = None,
             rank_state: dict[str, Any] | None = None, *, defer_copy: bool = False) -> None:
        """Save `state` (rank 0's full state) and this rank's `rank_state` (default: its RNG states) as
        checkpoint `step`; every rank calls this. With `async_save` the tensors are copied now and the
        files are written in the background; at most one save is in flight.

        `defer_copy` (async saves): the copy, too, is made in the background, so `save` returns at once;
        the caller promises not to modify the state's tensors before `wait_for_copy()` returns. The
        Trainer calls it before each optimizer step: the copy overlaps the next forward and backward,
        which read the parameters but do not write them (buffers they do write, e.g. BatchNorm
        statistics, must be copied by the caller first: the Trainer does)."""
        self._settle("save")
        rank_state = {"rng": rng_state()} if rank_state is None else rank_state
        self._prepare_folder(step)
        sharded = is_sharded(state) or bool(state.get("local_parts"))  # decided once: it walks the whole state
        skeleton = None
        if state.get("local_parts") and self._distributed():  # each rank holds other keys (pipeline stages)
            skeleton = merge_skeletons(gather_json(flatten(state)[0]))
        if self.cfg.async_save and sharded and self._distributed() and self._dcp_group is None:
            # DCP's own collectives run in the background thread; on the default group they would
            # interleave with training's (measured: hangs, gloo size mismatches), so they get a group
            # of their own. Created here, where every rank is (it is a collective call).
            problem = loopback_gloo(self.world_size, self.runtime.launch.local_world_size)
            if self._any_rank_failed(problem is not None, collective=True):  # every rank takes the same path
                self._dcp_group = False
                if problem:
                    log.warning("checkpoint.async_save: saving synchronously, since a gloo group for the background "
                                "saves would not reach the other nodes from this one: %s", problem)
            else:
                self._dcp_group = dist.new_group(backend="gloo")
        if self.cfg.async_save and not (sharded and self._dcp_group is False):
            # a full layout is written by rank 0 alone: the other ranks copy only their own state (their RNG)
            both = {"state": state if sharded or self.rank == 0 else {}, "rank": rank_state}
            self._copied = threading.Event()
            if not defer_copy:
                both = self._staging.copy(both)
                self._copied.set()
            self._pending = threading.Thread(target=self._save_in_background, name="disttrain-ckpt",
                                             args=(step, both, metrics, sharded, skeleton), daemon=True)
            self._pending.start()
        else:
            self._save(step, state, metrics, rank_state, collective=True, sharded=sharded, skeleton=skeleton)

    def _save_in_background(self, step, both, metrics, sharded: bool, skeleton) -> None:
        try:
            if self.runtime is not None and self.runtime.device.type == "cuda":
                torch.cuda.set_device(self.runtime.device)  # a new thread starts on GPU 0, whatever the rank's
            failure = None
            if not self._copied.is_set():
                try:
                    both = self._staging.copy(both)
                except Exception as exc:  # the others still wait for this rank in the save's agreement
                    failure = exc
                finally:
                    self._copied.set()
            self._save(step, both["state"], metrics, both["rank"], collective=False, sharded=sharded,
                       skeleton=skeleton, failure=failure)
        except BaseException as exc:  # surfaced by wait()
            self._pending_error = exc

    def wait_for_copy(self) -> None:
        """Block until the in-flight async save has its own copy of the state (see `save(defer_copy=)`)."""
        if self._copied is not None:
            self._copied.wait()

    def wait(self) -> None:
        """Block until the in-flight async save (if any) is done; raise its error."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None
        if self._pending_error is not None:
            error, self._pending_error = self._pending_error, None
            raise error

    def _prepare_folder(self, step: int) -> None:
        """Rank 0 creates an empty `step_<N>/` (removing a stale one); then every rank may write, or, if rank 0
        could not, every rank raises (the agreement is the barrier)."""
        path, error = self.path(step), None
        if self.rank == 0:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                if path.exists():  # left by an interrupted save, or a re-save of this step
                    remove_checkpoint(path)
                path.mkdir()
            except OSError as exc:
                error = CheckpointError(describe_os_error(exc, path))
        if self._any_rank_failed(error is not None, collective=True):
            raise error or CheckpointError(f"checkpoint {path}: rank 0 could not create the folder (its log says why)")

    def _save(self, step: int, state, metrics, rank_state, collective: bool, sharded: bool, skeleton=None,
              failure: BaseException | None = None) -> None:
        """Write, agree, commit (see the module's protocol). `failure`: this rank could not even copy its state (an
        async save): it writes nothing, and takes part in the agreements, which then fail the save on every rank."""
        path = self.path(step)
        error, files = None, {}
        try:
            if failure is not None:
                raise failure
            files = write_state(path, f"rank{self.rank}", rank_state)
            if self.rank == 0:  # the full state, or a sharded state's skeleton
                files.update(write_skeleton(path, state, skeleton) if sharded else write_state(path, "state", state))
        except OSError as exc:
            error = CheckpointError(describe_os_error(exc, path))
        except Exception as exc:  # (not only the disk: the ranks must agree whatever failed)
            error = CheckpointError(f"cannot write checkpoint {path}: {type(exc).__name__}: {exc}; earlier "
                                    "checkpoints are untouched")
        if sharded:  # every rank writes its shards through DCP, whose write is collective: all ranks enter it or none
            group = None if collective else self._dcp_group
            if self._any_rank_failed(error is not None, True, group):
                error = error or CheckpointError(f"checkpoint {path} not committed: another rank failed to write")
            else:
                error = write_dcp(path, state, group, files)
        if error is None:
            try:  # atomically: rank 0 polls for this file during async saves and must never read it half written
                listing = json.dumps({k: vars(v) for k, v in files.items()}).encode()
                atomic_write(path / f"files_rank{self.rank}.json", listing)
            except OSError as exc:
                error = CheckpointError(describe_os_error(exc, path))
        if error is not None and not collective:  # tell rank 0 now rather than let it wait for the timeout
            try_write(path / f"files_rank{self.rank}.json", json.dumps({"__error__": str(error)}).encode())
        failed = self._any_rank_failed(error is not None, collective)
        if not failed and self.rank == 0:
            try:
                commit(self.dir, step, path, self.world_size, self.info, metrics or {},
                       timeout=None if collective else self.timeout_s, layout="dcp" if sharded else "full")
            except OSError as exc:
                error, failed = CheckpointError(describe_os_error(exc, path)), True
            except CheckpointError as exc:
                error, failed = exc, True
            except Exception as exc:  # (whatever it is, the others wait for rank 0's word below)
                error, failed = CheckpointError(f"checkpoint {path} not committed: {type(exc).__name__}: {exc}"), True
        if failed and self.rank == 0:
            try:  # before any rank hears of the failure (and looks at the folder)
                remove_checkpoint(path)
            except OSError as exc:  # (a file system gone read-only: the broadcast below must still happen)
                log.warning("checkpoint %s failed and could not be removed: %s", path, exc)
        if collective:  # rank 0 committed alone: every rank learns whether it did
            failed = bool(self.rank0(int(failed)))
        if failed:
            raise error or CheckpointError(f"checkpoint {path} not committed: another rank failed (its log says why)")
        if self.rank == 0:
            try:  # (after the commit every rank has gone on: rotation's trouble is rank 0's warning, not an error)
                self._rotate(keep=step)
            except OSError as exc:
                log.warning("checkpoint step %d committed, but removing older ones failed: %s", step, exc)

    def _any_rank_failed(self, failed: bool, collective: bool, group=None) -> bool:
        """Whether any rank failed (`collective`: one all-reduce; else this rank's own view). `group`: the background
        saves' gloo group (on the host), from their thread; None: the default group, on the job's device."""
        if not (collective and self._distributed()):
            return failed
        flag = torch.tensor([1.0 if failed else 0.0], device="cpu" if group else self.runtime.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group or None)
        return bool(flag.item())

    # -- load --------------------------------------------------------------------------------------

    def load(self, step: int | str = "latest", target=None) -> dict[str, Any]:
        """The state saved at `step` ("latest": the newest committed checkpoint that verifies), with this
        rank's per-rank state under "rank_state" and the manifest under "manifest".

        Every file is checked against the manifest before anything is deserialised: each rank checks the files
        it reads, and the ranks share the rest (DCP's shard files: each hashed by one rank), then agree. With
        "latest", a bad checkpoint is skipped with a warning naming the bad file; rank 0 proposes and all ranks
        follow. A sharded checkpoint whose shard file the loader refuses (checksums forged to match) is bad too.
        For a sharded (DCP) checkpoint, `target(key, size, dtype)` gives the tensor each saved tensor is
        loaded into (a DTensor receives its shard); by default a full tensor on every rank.
        """
        self._settle("load")
        below = None  # after a bad checkpoint: only older ones
        while True:
            chosen = self.rank0(self._candidate(step, below) if self.rank == 0 else -1)
            if chosen < 0:
                raise CheckpointError(f"no valid checkpoint to load in {self.dir}")
            files, problem = self._verify(chosen)
            if problem is None:
                try:
                    return self._state(*files, path=self.path(chosen), target=target)
                except ChecksumError as exc:  # raised by the collective DCP load on every rank alike (dcp.py)
                    problem = str(exc)
            if step != "latest":
                raise CheckpointError(f"checkpoint step {chosen} is not valid: {problem}")
            if self.rank == 0:
                log.warning("skipping checkpoint step %d: %s", chosen, problem)
            below = chosen

    def has_checkpoint(self) -> bool:
        """Whether rank 0 sees a checkpoint in the folder, on every rank (collective: `rank0`)."""
        return bool(self.rank0(int(self.rank == 0 and bool(self.list()))))

    def rank0(self, value: int) -> int:
        """Rank 0's `value` on every rank (one broadcast; collective): what the folder holds, as rank 0 sees it, for
        decisions every rank must take alike. Another rank's view of shared storage may lag (NFS), or the folder
        may not be shared at all; then it loads what rank 0 chose, and a missing file is named."""
        if not self._distributed():
            return value
        box = torch.tensor([value], dtype=torch.int64, device=self.runtime.device)
        dist.broadcast(box, src=0)
        return int(box.item())

    def _candidate(self, step: int | str, below: int | None) -> int:
        """Rank 0: the checkpoint to try (the newest committed one with "latest", older than `below` if given);
        -1 when none is left."""
        if step != "latest":
            return int(step) if below is None else -1
        older = [s for s in self.list() if below is None or s < below]
        return older[-1] if older else -1

    def _verify(self, step: int) -> tuple[tuple | None, str | None]:
        """(manifest, the verified files this rank reads), or the first problem any rank found, on every rank
        alike (collective). Each rank checks what it deserialises; DCP's shard files are checked once over the job."""
        own = (f"rank{self.rank}.", f"rank{self.rank}-")
        try:
            files = read_checkpoint_files(self.path(step), reads=lambda name: name.startswith(("state", *own))
                                          or name == DCP_METADATA, share=(self.rank, self.world_size),
                                          shared=lambda name: name.endswith(".distcp"))
            problem = None
        except (ChecksumError, OSError, ValueError, KeyError, TypeError) as exc:
            files, problem = None, str(exc)
        if not self._distributed():
            return files, problem
        found = [(rank, p) for rank, p in enumerate(gather_json(problem)) if p is not None]
        if not found:
            return files, None
        rank, first = found[0]
        return None, first if rank == 0 else f"{first} (found by rank {rank})"

    def _state(self, manifest: dict[str, Any], blobs: dict[str, torch.Tensor], path: Path, target=None
               ) -> dict[str, Any]:
        if manifest.get("layout", "full") == "full":
            state = read_state(blobs, "state")
        else:
            state = read_sharded(path, json.loads(blobs["state.json"].numpy().tobytes())["skeleton"], target)
        rank_name = f"rank{self.rank}"
        state["rank_state"] = read_state(blobs, rank_name) if f"{rank_name}.json" in blobs else None
        state["manifest"] = manifest
        return state
