"""`disttrain train --launcher ray --nproc N`: the same Trainer on N Ray actors (optional extra `ray`).

Where torchrun starts this node's processes, Ray places the ranks anywhere in its cluster: one placement group of
N bundles (`dist.ray_cpus_per_worker`, `dist.ray_gpus_per_worker`, `dist.ray_resources`, `dist.ray_placement`),
one actor per bundle. This process hosts the rendezvous store (as torchrun's agent does), gives each actor the
environment torchrun would (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR/PORT), and
each actor runs `disttrain.run.main` on the saved config: the same Trainer, data order, checkpoints and status files,
hence the same losses as under torchrun. The watchdog and the failure summary are the launcher's own
(`watchdog.py`): a rank that dies or raises ends the attempt (the other actors are killed, as torchrun stops the
group), a hung rank is named; `--max-restarts K` starts new actors up to K times, each resuming from the newest
committed checkpoint. The terminal is torchrun's too: each actor writes its stdout and stderr to
`RUN_DIR/logs/ray/attempt_N/RANK/{stdout,stderr}.log`, and this process tails them as `[rank R] ...` lines under
one live progress bar (console.py). SIGTERM or SIGINT here is forwarded to every rank (a signal sent on the
rank's node, wherever it is), so each finishes its step and checkpoints as under torchrun; the job exits 128 +
signal. On several nodes, `run.out_dir` must be storage every node sees (checkpoints, status files, logs).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path

from disttrain.config import GPU_BOUND_ENV, Config, ray_resources
from disttrain.console import DRAWS_ENV, Console
from disttrain.service.ray_launcher import connect, local_ranks, node_order, place
from disttrain.signals import install_stop_handler, restore_handlers


class _TrainActor:
    """The body of each rank's actor (made a Ray class lazily, so importing this module never needs Ray)."""

    def where(self) -> dict:
        import ray

        context = ray.get_runtime_context()
        return {"node": context.get_node_id(), "pid": os.getpid(), "host": socket.gethostname(),
                "ip": ray.util.get_node_ip_address(), "gpus": [str(g) for g in ray.get_gpu_ids()]}

    def run(self, config_path: str, env: dict[str, str], log_dir: str) -> int:
        os.environ.update(env)
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        for fd, name in ((1, "stdout.log"), (2, "stderr.log")):  # as torchrun's --redirects 3: files per rank
            (sys.stdout if fd == 1 else sys.stderr).flush()
            out = os.open(os.path.join(log_dir, name), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(out, fd)
            os.close(out)
        from disttrain.run import main

        return main([config_path])


def _send_signal(pid: int, signum: int) -> None:
    """Run on a rank's node (a Ray task pinned there): deliver `signum` to the rank's process."""
    try:
        os.kill(pid, signum)
    except ProcessLookupError:  # it has ended meanwhile
        pass


class _Forward:
    """SIGTERM/SIGINT in the launcher, recorded by the handler and forwarded to the ranks by the wait loop (no
    Ray calls inside a signal handler). A second signal kills the actors."""

    def __init__(self):
        self.signum: int | None = None
        self.count = 0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> _Forward:
        self._previous = install_stop_handler(self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.signum = self.signum or signum
        self.count += 1

    def __exit__(self, *exc) -> None:
        restore_handlers(self._previous)


def launch_ray(cfg: Config, config_path: Path, max_restarts: int = 0) -> int:
    """Run the job on Ray actors; the job's exit code (0, 2 for a user error, or the first failed rank's)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    d, procs, run_dir = cfg.dist, cfg.dist.nproc, cfg.run_dir
    ray = connect(d.ray_address or None)
    bundle = {"CPU": d.ray_cpus_per_worker, **({"GPU": d.ray_gpus_per_worker} if d.ray_gpus_per_worker else {}),
              **ray_resources(d.ray_resources)}
    group = place(ray, bundle, procs, d.ray_placement, d.startup_timeout_s)
    actor_cls = ray.remote(_TrainActor)
    print(f"disttrain: launching {procs} ranks as Ray actors ({d.ray_placement}, {bundle} each); run dir {run_dir}",
          file=sys.stderr, flush=True)
    try:
        with _Forward() as stop:
            for attempt in range(max_restarts + 1):
                actors = [actor_cls.options(
                    num_cpus=d.ray_cpus_per_worker, num_gpus=d.ray_gpus_per_worker,
                    resources=ray_resources(d.ray_resources) or None,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank)
                ).remote() for rank in range(procs)]
                code = _attempt(ray, actors, cfg, config_path, attempt, stop)
                for actor in actors:
                    ray.kill(actor, no_restart=True)
                if stop.signum:
                    print(f"disttrain: stopped by {signal.Signals(stop.signum).name}; every rank finished its step "
                          "and exited", file=sys.stderr, flush=True)
                    return 128 + stop.signum
                if code == 0 or code == 2 or attempt == max_restarts:
                    return code
            print(f"disttrain: restarting the group (restart {attempt + 1} of {max_restarts}); each rank resumes "
                  "from the newest committed checkpoint", file=sys.stderr, flush=True)
    finally:
        ray.util.remove_placement_group(group)
    return 1


def _attempt(ray, actors, cfg: Config, config_path: Path, attempt: int, stop: _Forward) -> int:
    """One generation of actors running the job; its exit code, after printing the summary if it failed. After a
    signal (`stop`) every rank is waited for: each finishes its step and checkpoints."""
    import torch.distributed as dist

    from disttrain.monitor import WATCHED_ENV, clear_statuses
    from disttrain.watchdog import Watchdog, summary

    d, procs, run_dir = cfg.dist, cfg.dist.nproc, cfg.run_dir
    places = ray.get([a.where.remote() for a in actors], timeout=d.startup_timeout_s)
    order = node_order([p["node"] for p in places], [p["gpus"] for p in places])  # a node's ranks together
    actors, places = [actors[i] for i in order], [places[i] for i in order]
    nodes = list(dict.fromkeys(p["node"] for p in places))
    here = len(nodes) == 1 and places[0]["host"] == socket.gethostname()
    host = "127.0.0.1" if here else ray.util.get_node_ip_address()  # loopback unless ranks run elsewhere
    store = dist.TCPStore(host, 0, procs, is_master=True, wait_for_workers=False)
    clear_statuses(run_dir)
    total = (cfg.train.stop_at or cfg.train.steps) if cfg.log.progress else 0
    logs = run_dir / "logs"
    refs = []
    local = local_ranks([p["node"] for p in places], [p["gpus"] for p in places])
    for rank, (actor, where) in enumerate(zip(actors, places, strict=True)):
        env = {"RANK": str(rank), "WORLD_SIZE": str(procs), "GROUP_RANK": str(nodes.index(where["node"])),
               "LOCAL_RANK": str(local[rank][0]), "LOCAL_WORLD_SIZE": str(local[rank][1]),
               GPU_BOUND_ENV: "1" if where["gpus"] else "0",
               "MASTER_ADDR": host, "MASTER_PORT": str(store.port),
               "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": str(attempt),
               DRAWS_ENV: "1" if total else "0",  # this process draws the bar
               WATCHED_ENV: str(run_dir.resolve()),  # (not one an outer launcher left in Ray's environment)
               "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
        refs.append(actor.run.remote(str(config_path), env, str(logs / "ray" / f"attempt_{attempt}" / str(rank))))
    failures: dict[int, str] = {}
    codes: dict[int, int] = {}
    console = Console(logs, run_dir / "metrics.jsonl" if total else None, total)
    console.start()
    forwarded = 0
    try:
        with Watchdog(run_dir, d.timeout_s, d.startup_timeout_s) as watchdog:
            pending = list(refs)
            while pending and (stop.signum or not failures):
                if stop.count > forwarded:  # a signal arrived: pass it on (a second one: kill)
                    forwarded = stop.count
                    _forward(ray, actors, places, signal.SIGTERM if forwarded == 1 else signal.SIGKILL)
                done, pending = ray.wait(pending, num_returns=1, timeout=0.25)
                for ref in done:
                    rank = refs.index(ref)
                    try:
                        codes[rank] = ray.get(ref)
                        if codes[rank]:
                            failures[rank] = f"exited with code {codes[rank]}"
                    except Exception as exc:  # ActorDiedError: killed (a signal, the watchdog, the OOM killer)
                        failures[rank] = f"its Ray actor died ({type(exc).__name__})"
            if failures and not stop.signum:
                time.sleep(1.0)  # the others' status files settle (a rank that raised writes its error)
    finally:
        console.stop()
    del store
    if not failures or stop.signum:
        return 0 if not failures else 128 + stop.signum
    print(summary(run_dir, failures, watchdog.stuck, stacks=watchdog.stacks), file=sys.stderr, flush=True)
    own = [codes[r] for r in sorted(codes) if codes[r] > 0]
    return 2 if 2 in own else (own[0] if own else 1)


def _forward(ray, actors, places: list[dict], signum: int) -> None:
    """`signum` to every rank's process: directly on this host, through a task pinned to the rank's node elsewhere
    (SIGKILL: the actors are killed through Ray)."""
    if signum == signal.SIGKILL:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        return
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = socket.gethostname()
    sender = ray.remote(num_cpus=0)(_send_signal)
    for where in places:
        if where["host"] == here:
            _send_signal(where["pid"], signum)
        else:
            sender.options(scheduling_strategy=NodeAffinitySchedulingStrategy(where["node"], soft=False)).remote(
                where["pid"], signum)
