"""The Ray backend of the worker tier: workers are Ray actors in a placement group (optional extra `ray`).

Ray places and supervises the processes (PACK or SPREAD bundles, CPUs, fractional GPUs, custom
resources, several nodes); everything else is the same as the local backend: each actor runs
`worker.serve`, connects back to the driver, and the actors form the torch process group among
themselves through the driver's rendezvous store. Only strings and numbers go through Ray's own calls;
commands and tensors travel on the disttrain wire (JSON + safetensors, no pickle).

A Ray actor is a lean process group: measured here, two actors formed a gloo group and trained in ~3 s,
where Ray Train's `TorchTrainer.fit()` took ~38 s for the same job.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from typing import Any

from disttrain.service.group import WorkerFailure


def _import_ray():
    try:
        import ray
    except ImportError:
        from disttrain.config import ConfigError

        raise ConfigError("backend = 'ray' needs Ray: pip install 'disttrain[ray]'") from None
    return ray


def _running_local_cluster() -> bool:
    """Whether `ray start` left a cluster on this machine that `ray.init()` would join (its address file)."""
    import tempfile

    return os.path.exists(os.path.join(tempfile.gettempdir(), "ray", "ray_current_cluster"))


def connect(address: str | None):
    """Join the Ray cluster at `address` (None: RAY_ADDRESS, a cluster `ray start` left here, or a new local one,
    with token auth on and the token kept in this process's environment, never in ~/.ray); returns `ray`."""
    ray = _import_ray()
    if not ray.is_initialized():
        if address is None and "RAY_ADDRESS" not in os.environ and not _running_local_cluster():
            os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
        ray.init(address=address, include_dashboard=False, log_to_driver=True, configure_logging=False)
    return ray


def place(ray, bundle: dict[str, float], procs: int, strategy: str, timeout_s: float):
    """A placement group of `procs` bundles, ready; refused at once (one line) if the cluster could never hold
    it, a WorkerFailure if it is not placed within `timeout_s`."""
    from ray.util.placement_group import placement_group

    _check_feasible([n["Resources"] for n in ray.nodes() if n.get("Alive")], bundle, procs)
    group = placement_group([dict(bundle) for _ in range(procs)], strategy=strategy)
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        ray.util.remove_placement_group(group)
        raise WorkerFailure(f"Ray could not place {procs} workers with {bundle} each ({strategy}) within "
                            f"{timeout_s:g} s; cluster resources: {ray.cluster_resources()}")
    return group


def node_order(nodes: list[str], gpus: list[list[str]]) -> list[int]:
    """The actors (by index) in rank order: grouped by node, the nodes in the order they first appear, and by GPU id
    within a node, as torchrun numbers a node's ranks. Bundle order alone interleaves nodes under SPREAD, which would
    put neighbouring ranks (a tensor-parallel pair, an HSDP shard group) on different nodes."""
    first = {node: i for i, node in reversed(list(enumerate(nodes)))}

    def key(i: int) -> tuple[int, int, int]:
        ids = [int(g) for g in gpus[i] if g.isdigit()]
        return first[nodes[i]], min(ids, default=-1), i

    return sorted(range(len(nodes)), key=key)


def local_ranks(nodes: list[str], gpus: list[list[str]]) -> list[tuple[int, int]]:
    """(local rank, ranks on its node) of each rank, as torchrun would set them, from the node each actor landed on:
    local rank 0 for an actor Ray gave GPUs (it sees only those), else its place among its node's ranks."""
    return [(0 if ids else nodes[:rank].count(node), nodes.count(node))
            for rank, (node, ids) in enumerate(zip(nodes, gpus, strict=True))]


class _Actor:
    """The body of each Ray actor (made a Ray class lazily, so importing this module never needs Ray)."""

    def serve(self, host: str, port: int, token: str, rank: int, world: int, heartbeat_s: float,
              env: dict[str, str]) -> int:
        os.environ.update(env)
        from disttrain.service.worker import serve

        return serve(host, port, token, rank, world, heartbeat_s)

    def where(self) -> dict[str, Any]:
        import ray

        context = ray.get_runtime_context()
        return {"node_id": context.get_node_id(), "pid": os.getpid(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "ip": ray.util.get_node_ip_address()}


def _driver_ip(ray) -> str | None:
    """The address of this driver's Ray node, or None where the driver is not on a node of the cluster."""
    if ray.util.client.ray.is_connected():  # a Ray client (ray://): this machine is no node of the cluster, and its
        return None  # address on the nodes' network is not Ray's to tell (a loopback service is not checked there)
    try:
        return ray.util.get_node_ip_address()
    except Exception:
        return None


def _check_feasible(nodes: list[dict[str, float]], bundle: dict[str, float], procs: int) -> None:
    """Refuse at once, in one line, what the cluster's nodes (their total resources) could never place: a worker
    larger than every node, or more workers than all of them hold. Ray would wait for such a placement group for
    ever; what is only busy now (held by another service) is waited for up to `startup_timeout_s`."""
    from disttrain.errors import ConfigError

    largest = {k: max((node.get(k, 0.0) for node in nodes), default=0.0) for k in bundle}
    total = {k: sum(node.get(k, 0.0) for node in nodes) for k in bundle}
    too_big = {k: v for k, v in bundle.items() if v > largest[k] + 1e-9}
    short = {k: v * procs for k, v in bundle.items() if v * procs > total[k] + 1e-9}
    if too_big or short:
        need = too_big or short
        what = "one worker needs" if too_big else f"{procs} workers need"
        has = ", ".join(f"{k} {(largest if too_big else total)[k]:g}" for k in need)
        raise ConfigError(f"Ray cannot place {procs} workers of {bundle}: {what} "
                          f"{', '.join(f'{k} {v:g}' for k, v in need.items())} and the cluster has {has} "
                          f"{'on its largest node' if too_big else 'in all'}; ask for less (cpus_per_worker, "
                          "gpus_per_worker, resources_per_worker, nproc) or add nodes")


def check_reachable(host: str, driver_ip: str | None, worker_ips: list[str]) -> None:
    """Refuse, in one line, workers Ray placed on other machines than the driver's while the service listens on this
    machine only (loopback): they could never connect, and would time out after `startup_timeout_s`. Machines are
    told apart by their nodes' addresses (several Ray nodes of one machine share it); `driver_ip` None: the driver is
    not on a node of the cluster (a Ray client), and nothing is checked."""
    from disttrain.errors import ConfigError
    from disttrain.runtime import is_loopback

    loopback = is_loopback(host)
    away = [rank for rank, ip in enumerate(worker_ips) if ip != driver_ip]
    if driver_ip is None or not loopback or not away:
        return
    raise ConfigError(f"Ray placed worker(s) {', '.join(map(str, away))} on other machines than this driver's "
                      f"({', '.join(sorted({worker_ips[r] for r in away}))}), and the service listens on {host}, "
                      f"which they cannot reach; set TrainingService.options(host=...) to this machine's address on "
                      f"the network between the nodes (Ray knows it as {driver_ip}): the workers connect there, each "
                      "with the service's token")


class RayLauncher:
    """Starts `procs` actors, one per placement-group bundle; `exit_status` reports a dead actor."""

    name = "ray"

    def __init__(self, options):
        self.options = options
        self.actors: list[Any] = []
        self.refs: list[Any] = []
        self.nodes: list[str] = []
        self.gpus: list[list[str]] = []  # Ray's GPU ids per worker (its CUDA_VISIBLE_DEVICES)
        self.group = None

    async def spawn(self, host: str, port: int, token: str, procs: int, heartbeat_s: float) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        o = self.options
        ray = connect(o.ray_address)
        bundle = {"CPU": o.cpus_per_worker, **({"GPU": o.gpus_per_worker} if o.gpus_per_worker else {}),
                  **o.resources_per_worker}
        self.group = await asyncio.to_thread(place, ray, bundle, procs, o.placement, o.startup_timeout_s)
        actor_cls = ray.remote(_Actor)
        env = {**o.env, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
        for rank in range(procs):
            actor = actor_cls.options(
                num_cpus=o.cpus_per_worker, num_gpus=o.gpus_per_worker, resources=o.resources_per_worker or None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=rank),
            ).remote()
            self.actors.append(actor)
        places = await asyncio.to_thread(ray.get, [a.where.remote() for a in self.actors],
                                         timeout=o.startup_timeout_s)
        order = node_order([w["node_id"] for w in places], [w["gpu_ids"] for w in places])
        self.actors, places = [self.actors[i] for i in order], [places[i] for i in order]
        self.nodes = [w["node_id"] for w in places]
        self.gpus = [w["gpu_ids"] for w in places]
        check_reachable(host, _driver_ip(ray), [w["ip"] for w in places])
        self.refs = [a.serve.remote(host, port, token, rank, procs, heartbeat_s, env)
                     for rank, a in enumerate(self.actors)]

    def exit_status(self, rank: int) -> str | None:
        if not self.refs:
            return None
        ray = _import_ray()
        done, _ = ray.wait([self.refs[rank]], timeout=0)
        if not done:
            return None
        try:
            return f"(Ray actor) exited with code {ray.get(done[0])}"
        except Exception as exc:  # ActorDiedError and friends
            return f"(Ray actor) died: {str(exc).splitlines()[0]}"

    def node(self, rank: int) -> str:
        return self.nodes[rank] if rank < len(self.nodes) else ""

    async def stop(self, timeout_s: float = 10.0) -> None:
        if self.refs:
            ray = _import_ray()
            await asyncio.to_thread(ray.wait, self.refs, num_returns=len(self.refs), timeout=timeout_s)
        await self.kill()

    async def kill(self) -> None:
        if not self.actors and self.group is None:
            return
        ray = _import_ray()
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        if self.group is not None:
            ray.util.remove_placement_group(self.group)
        self.actors, self.refs, self.group = [], [], None
