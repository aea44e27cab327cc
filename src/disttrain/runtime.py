"""Who am I: rank, local rank, world, node, device and backend; init and teardown of the process group.

The launch environment is read once, by `detect_launch(environ)` (a pure function of the environment
mapping), and the result travels explicitly as a `Runtime` object: nothing else in disttrain reads
RANK/WORLD_SIZE or asks torch.distributed who it is.
"""

from __future__ import annotations

import gc
import logging
import os
import re
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from disttrain.config import GPU_BOUND_ENV, NODE_CLAIM_ENV, DistConfig
from disttrain.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LaunchInfo:
    launcher: str  # "torchrun", "slurm" or "single"
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0


def _ints(env: Mapping[str, str], *names: str) -> list[int]:
    try:
        return [int(env[name]) for name in names]
    except ValueError as exc:
        raise RuntimeError(f"launcher environment variable is not an integer: {exc}") from None


def detect_launch(env: Mapping[str, str]) -> LaunchInfo:
    """torchrun (RANK/WORLD_SIZE/LOCAL_RANK), Slurm (SLURM_PROCID/SLURM_NTASKS/...) or one process."""
    if all(name in env for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        rank, world, local = _ints(env, "RANK", "WORLD_SIZE", "LOCAL_RANK")
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
        node = int(env.get("GROUP_RANK", rank // max(local_world, 1)))
        return LaunchInfo("torchrun", rank, local, world, local_world, node)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, world = _ints(env, "SLURM_PROCID", "SLURM_NTASKS")
        local = int(env.get("SLURM_LOCALID", 0))
        # --ntasks-per-node sets the first; Slurm always sets the second ("8(x2)": 8 tasks on each of 2 nodes)
        per_node = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "1"
        local_world = int(per_node.split("(")[0].split(",")[0] or 1)
        node = int(env.get("SLURM_NODEID", 0))
        return LaunchInfo("slurm", rank, local, world, local_world, node)
    return LaunchInfo("single")


@dataclass(frozen=True)
class Runtime:
    """The facts about this process in the job, passed to every component that needs them."""

    launch: LaunchInfo
    device: torch.device
    backend: str  # process-group backend ("gloo"/"nccl"); meaningful when distributed
    distributed: bool  # a process group is initialised

    @property
    def rank(self) -> int:
        return self.launch.rank

    @property
    def local_rank(self) -> int:
        return self.launch.local_rank

    @property
    def world_size(self) -> int:
        return self.launch.world_size

    @property
    def node_rank(self) -> int:
        return self.launch.node_rank

    def is_main_process(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.distributed:
            if self.device.type == "cuda":
                dist.barrier(device_ids=[self.device.index])
            else:
                dist.barrier()


def pick_device(device: str, local_rank: int, visible: int | None = None, bound: bool = False) -> torch.device:
    """The rank's device: GPU `local_rank` of those it sees (`visible`, default torch.cuda.device_count()), or GPU 0
    where it sees one that is bound to it (`bound`: Slurm's `--gpus-per-task`, which gives each task a GPU of its own,
    or the node's ranks each seeing another GPU: `one_gpu_each`; Ray's actors come as local rank 0); ConfigError where
    it sees fewer than its local rank needs (two ranks would share a GPU: nccl refuses). A CUDA_VISIBLE_DEVICES of one
    GPU alone binds nothing: torchrun gives every rank the same, as does Slurm's `--gres=gpu:1` to each task."""
    if _wants_cuda(device):
        visible = torch.cuda.device_count() if visible is None else visible
        if visible == 1 and (bound or local_rank == 0):
            return torch.device("cuda", 0)
        if visible and local_rank >= visible:
            raise ConfigError(f"local rank {local_rank} needs GPU {local_rank}, and this process sees {visible} "
                              f"GPU(s): start at most {visible} ranks per node (--nproc), or one GPU per rank")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _wants_cuda(device: str) -> bool:
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def one_gpu_each(store, node: str, local_world: int, gpu: str) -> bool:
    """Whether the `local_world` ranks of `node`, each seeing one GPU, see different ones (`gpu`: its UUID), as a
    CUDA_VISIBLE_DEVICES of each rank's own gives them (a wrapper script per rank, Slurm's `--gpu-bind`); through the
    rendezvous store, before the process group (which needs the device) forms. Every such rank of the node calls it;
    they are numbered by arrival, not by local rank."""
    prefix = f"disttrain/one_gpu/{node}"
    store.set(f"{prefix}/{store.add(f'{prefix}/arrived', 1) - 1}", gpu)
    keys = [f"{prefix}/{i}" for i in range(local_world)]
    try:
        store.wait(keys)
    except Exception:  # DistStoreError (a timeout) in recent torch, RuntimeError in older ones
        came = sum(store.check([key]) for key in keys)
        raise ConfigError(f"{local_world - came} of the {local_world} ranks on {node} see more than one GPU, and "
                          f"{came} see one: give every rank of a node the same CUDA_VISIBLE_DEVICES, or each a GPU "
                          "of its own") from None
    return len({store.get(key) for key in keys}) == local_world


def pick_backend(backend: str, device: torch.device) -> str:
    if backend != "auto":
        return backend
    return "nccl" if device.type == "cuda" else "gloo"


def init_runtime(cfg: DistConfig, environ: Mapping[str, str] | None = None, always_form_group: bool = False
                 ) -> Runtime:
    """Detect the launcher, pick device and backend, and form the process group when world > 1.

    `always_form_group` forms a one-process group even in a single process (in-memory store, no network):
    strategies such as DDP or FSDP then run unchanged at world size 1, e.g. to resume a 2-rank FSDP
    checkpoint on one process. An existing process group (formed by the user) is used as it is.
    """
    env = os.environ if environ is None else environ
    info = detect_launch(env)
    bound = env.get(GPU_BOUND_ENV) == "1" or (info.launcher == "slurm" and bool(env.get("SLURM_GPUS_PER_TASK")))
    store = None  # the rendezvous store, opened early where the ranks of a node must compare their GPUs
    if (not bound and info.local_world_size > 1 and not dist.is_initialized() and _wants_cuda(cfg.device)
            and torch.cuda.device_count() == 1):
        if info.launcher == "slurm":
            _slurm_rendezvous_env()
        store = _attempt_store(info, cfg.timeout_s)
        bound = one_gpu_each(store, f"{socket.gethostname()} (node {info.node_rank})", info.local_world_size,
                             str(torch.cuda.get_device_properties(0).uuid))
    device = pick_device(cfg.device, info.local_rank, bound=bound)
    backend = pick_backend(cfg.backend, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    threads = cfg.threads_per_rank or max(1, (os.cpu_count() or 1) // max(info.local_world_size, 1))
    torch.set_num_threads(threads)
    if info.world_size == 1 and not always_form_group and not dist.is_initialized():
        return Runtime(info, device, backend, distributed=False)
    # Collectives time out only after either watchdog limit (watchdog.py): the launcher's watchdog names a
    # rank that stopped making progress, rather than racing a peer's collective timeout that names no one.
    timeout = timedelta(seconds=cfg.timeout_s + cfg.startup_timeout_s)
    if backend == "nccl":  # nccl times each collective on the device, for comm_s (parallel/comm.py)
        os.environ.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")
    if not {"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"} & os.environ.keys():  # (monitor.py reads it)
        os.environ["TORCH_FR_BUFFER_SIZE"] = str(cfg.flight_recorder)
    if info.world_size == 1 and not dist.is_initialized():
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    elif not dist.is_initialized():
        if info.launcher == "slurm":
            _slurm_rendezvous_env()
        problem = loopback_gloo(info.world_size, info.local_world_size) if backend == "gloo" else None
        if problem:
            raise ConfigError(f"dist.backend = gloo on several nodes: {problem}")
        dist.init_process_group(
            backend=backend,
            store=store or _attempt_store(info, cfg.timeout_s),
            rank=info.rank,
            world_size=info.world_size,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
        )
    runtime = Runtime(info, device, dist.get_backend(), distributed=True)
    _check_world_agrees(runtime)
    _check_node_ranks(runtime, env)
    return runtime


def _attempt_store(info: LaunchInfo, timeout_s: float):
    """The rendezvous store (MASTER_ADDR/PORT), under a prefix per torchrun restart attempt.

    Measured with torch 2.13 on loopback: after a restart, ranks sometimes read their peers' addresses from
    the previous attempt out of the agent's store and hang in gloo's connectFullMesh ("Connection refused")
    until the timeout. A fresh key prefix per attempt makes every attempt's rendezvous its own.
    """
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), info.world_size,
                          is_master=info.rank == 0 and not agent_store, timeout=timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    return dist.PrefixStore(f"disttrain/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: "gpu[003-010,012],big1" -> "gpu003" (what `scontrol show hostnames`
    lists first)."""
    host, depth = [], 0
    for char in nodelist.strip():  # the first entry: up to a comma outside brackets
        if char == "," and not depth:
            break
        depth += {"[": 1, "]": -1}.get(char, 0)
        host.append(char)
    # each bracket's first value: "[003-010,012]" -> "003"
    return re.sub(r"\[([^\]]*)\]", lambda m: m.group(1).split(",")[0].split("-")[0], "".join(host))


def is_loopback(host: str) -> bool:
    """Whether `host`, as written, names this machine only (127.x, localhost, ::1); no name is resolved."""
    host = host.strip()
    return host.startswith("127.") or host in ("localhost", "::1")


def loopback_gloo(world: int, local_world: int, hostname: str | None = None) -> str | None:
    """Why a gloo group would not reach the other nodes, or None. Without GLOO_SOCKET_IFNAME, gloo gives its peers
    the address this host's name resolves to; where that is a loopback address (Debian and Ubuntu map the name to
    127.0.1.1 in /etc/hosts), the ranks on other nodes cannot connect. One node, or a rendezvous given as a loopback
    address (every "node" on this machine, e.g. two Ray nodes started here): nothing to reach. (Not a name that
    resolves to loopback here: node 0's own name does, on the very machines this is about.)"""
    if world <= local_world or os.environ.get("GLOO_SOCKET_IFNAME"):
        return None
    import socket

    if is_loopback(os.environ.get("MASTER_ADDR", "")):
        return None
    host = hostname or socket.gethostname()
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return None  # (gloo itself says so when it cannot resolve the name)
    if not address.startswith("127."):
        return None
    return (f"this host's name {host!r} resolves to {address} (loopback), which gloo would give the ranks on the "
            "other nodes: export GLOO_SOCKET_IFNAME=<the network interface between the nodes, e.g. eth0>")


def _slurm_rendezvous_env() -> None:
    """Slurm gives ranks but no rendezvous address: use MASTER_ADDR/PORT if set, else the first node of the step
    (where rank 0 runs). Not the launch node (`SLURM_LAUNCH_NODE_IPADDR`): under `salloc` that is the login node."""
    if "MASTER_ADDR" not in os.environ:
        nodes = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST")
        if not nodes:
            raise ConfigError("Slurm launch without MASTER_ADDR or SLURM_JOB_NODELIST: export MASTER_ADDR=<the first "
                              "node's address>")
        os.environ["MASTER_ADDR"] = first_host(nodes)
    os.environ.setdefault("MASTER_PORT", str(29500 + int(os.environ.get("SLURM_JOB_ID", "0")) % 1000))


def _check_world_agrees(runtime: Runtime) -> None:
    """Every rank must see the same world size as the process group; never train silently undistributed."""
    seen = torch.tensor([runtime.world_size, -runtime.world_size], dtype=torch.int64, device=runtime.device)
    dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    pg_world = dist.get_world_size()
    if seen[0].item() != runtime.world_size or -seen[1].item() != runtime.world_size or pg_world != runtime.world_size:
        raise RuntimeError(
            f"rank {runtime.rank}: launcher says world size {runtime.world_size}, the process group has "
            f"{pg_world}, other ranks say {seen[0].item()}..{-seen[1].item()}; relaunch all ranks with one command"
        )


def _check_node_ranks(runtime: Runtime, env: Mapping[str, str]) -> None:
    """Two nodes given the same --node-rank: named on every rank before anything trains (ConfigError, exit 2).

    torchrun's c10d rendezvous numbers the nodes by arrival (GROUP_RANK), so a duplicate rank does not stop the
    rendezvous; but it is a mistake in the commands (one node was meant to be another), and the --node-rank decides
    which node clears the run's status files and which nodes wait for the endpoint. Every rank shares its node's
    claim and host name in one all_gather of integers (no pickle)."""
    claim, _, endpoint = env.get(NODE_CLAIM_ENV, "").partition("@")
    nodes = int(env.get("GROUP_WORLD_SIZE", "1"))
    if not claim or nodes <= 1:
        return
    import socket

    host = socket.gethostname().encode()[:62]
    mine = torch.tensor([int(claim), runtime.node_rank, len(host), *host, *[0] * (62 - len(host))],
                        dtype=torch.int64, device=runtime.device)
    rows = [torch.empty_like(mine) for _ in range(runtime.world_size)]
    dist.all_gather(rows, mine)
    by_node = {int(r[1]): (int(r[0]), bytes(r[3:3 + int(r[2])].tolist()).decode(errors="replace")) for r in rows}
    claims = sorted(c for c, _ in by_node.values())
    duplicates = sorted({c for c in claims if claims.count(c) > 1})
    if duplicates:
        twice = duplicates[0]
        hosts = ", ".join(h for c, h in by_node.values() if c == twice)
        missing = ", ".join(str(r) for r in range(nodes) if r not in claims) or "none"
        raise ConfigError(f"--node-rank {twice} was given to {claims.count(twice)} nodes ({hosts}) of the rendezvous "
                          f"at {endpoint}: node ranks seen {', '.join(map(str, claims))}, missing {missing}; give "
                          f"each of the {nodes} nodes its own --node-rank from 0 to {nodes - 1}")


def shutdown(runtime: Runtime, drain: bool = True) -> None:
    """Destroy the process group (call `exit_process` afterwards in a script that used DDP on gloo).

    `drain` (the normal end, every rank alive) first waits at a barrier, with the GIL released: gloo's
    worker threads finish destroying completed work (which needs the GIL to free Python tensors). Without
    it, the last reference to the group dropped later from Python (e.g. a DDP Reducer freed when a
    function returns) joins those threads while holding the GIL, and the process deadlocks (seen with
    torch 2.13). The same holds for wrappers still alive after the group is destroyed: so cyclic garbage
    is collected first, and scripts should drop their models/backends before calling this. On error paths
    `drain=False` skips the barrier, which a dead peer would never reach.
    """
    if runtime.distributed and dist.is_initialized():
        if drain:
            runtime.barrier()
        gc.collect()  # wrappers in reference cycles (DDP) must die while the group is still registered
        dist.destroy_process_group()


def exit_process(code: int = 0) -> None:
    """End a worker process after `shutdown`, skipping C++ static destructors.

    Measured with torch 2.13: once a DDP wrapper has existed, the gloo process group stays alive after
    `destroy_process_group` (its `gloo_tcp_loop`/`pt_gloo_runloop` threads keep running even when the
    wrapper is garbage-collected). At interpreter exit their destructors race and abort roughly one
    finished run in five ("terminate called without an active exception", SIGABRT), which torchrun
    reports as a failed job. Our files are closed by now, so flushing the streams and leaving with
    `os._exit` is safe. `python -m disttrain.run` does this; scripts run by `disttrain launch` should too.
    In a rank forked by launch_fork.py, `os._exit(0)` on the main thread raises SystemExit(0) instead
    (`launch_fork._exit_returning`): torch's agent waits for the rank's return.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def check_ranks_agree(cfg, runtime: Runtime, data: dict[str, int] | None = None) -> None:
    """Every rank must run the same config, disttrain and torch, and see the same data (`data`: how many training
    and evaluation samples): compared as hashes in one all-gather of integers (no pickling), so a mismatch is named
    before the first step instead of showing up as a hang (a rank with more evaluation rounds than the others) or
    as silently different data streams."""
    if not runtime.distributed or runtime.world_size == 1:
        return
    import hashlib

    from disttrain._version import __version__

    facts = {"config": cfg.hash(), "disttrain version": __version__, "torch version": torch.__version__,
             **{name: str(n) for name, n in (data or {}).items()}}
    mine = torch.tensor([int(hashlib.sha256(v.encode()).hexdigest()[:15], 16) for v in facts.values()],
                        dtype=torch.int64, device=runtime.device)
    everyone = [torch.empty_like(mine) for _ in range(runtime.world_size)]
    dist.all_gather(everyone, mine)
    for i, name in enumerate(facts):
        differing = [r for r, theirs in enumerate(everyone) if theirs[i] != everyone[0][i]]
        if differing:
            from disttrain.config import ConfigError

            if name in (data or {}):
                raise ConfigError(f"rank(s) {', '.join(map(str, differing))} see a different number of {name} than "
                                  f"rank 0 (here, rank {runtime.rank}: {facts[name]}); give every rank the same data "
                                  "(the same file, not one still being written nor a copy per node that differs)")
            raise ConfigError(f"rank(s) {', '.join(map(str, differing))} run a different {name} than rank 0 "
                              f"(here, rank {runtime.rank}: {facts[name]}); launch every rank with the same "
                              "config file, --set values and installation")
