"""A launch's plan: the launch flags `train` and `launch` share (`launch_arguments`, `nproc_of`), the LaunchPlan they
make (`launch_plan`), and `disttrain train --dry-run`: what a job would do, from its validated config; nothing
starts, nothing is written (`describe_plan`)."""

from __future__ import annotations

import argparse
import shlex

from disttrain.config import Config, ConfigError


def launch_arguments(p: argparse.ArgumentParser, nproc_default: str | None) -> None:
    """The launch flags `train` and `launch` share, with the spellings torchrun users type."""
    p.add_argument("--nproc", "--nproc-per-node", "--nproc_per_node", dest="nproc", default=nproc_default,
                   help="processes on this node: a number, or auto (GPUs if any, else 1), gpu (every GPU), cpu "
                        "(every core)")
    p.add_argument("--nnodes", default="1", help="nodes in the job, or MIN:MAX for elastic membership")
    p.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, default=0,
                   help="this node's rank (informational with c10d)")
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint",
                   help="HOST:PORT of the rendezvous, the same on every node")
    p.add_argument("--rdzv-id", "--rdzv_id", dest="rdzv_id",
                   help="the job's id at the rendezvous: give each multi-node job its own (default: 'disttrain'; "
                        "one node: a fresh one)")
    p.add_argument("--master-addr", "--master_addr", dest="master_addr",
                   help="torch.distributed.launch's spelling: the rendezvous host (with --master-port)")
    p.add_argument("--master-port", "--master_port", dest="master_port", type=int,
                   help="the rendezvous port (default 29500 with --master-addr)")
    p.add_argument("--max-restarts", "--max_restarts", dest="max_restarts", type=int, default=0,
                   help="restart the whole group up to K times when a rank fails; each restart resumes from "
                        "the newest committed checkpoint")


def nproc_of(value: str | int) -> int:
    """`--nproc`: a number, or auto / gpu / cpu (torchrun's words)."""
    import os

    text = str(value).strip().lower()
    if text.lstrip("-").isdigit():
        return int(text)  # (below 1: validation says so, naming dist.nproc)
    if text in ("auto", "gpu"):
        import torch

        gpus = torch.cuda.device_count()
        if text == "gpu" and not gpus:
            raise ConfigError("--nproc gpu: no CUDA GPU is visible on this node; use --nproc cpu or a number")
        return gpus or 1
    if text == "cpu":
        return os.cpu_count() or 1
    raise ConfigError(f"--nproc {value}: use a number of processes, or auto, gpu or cpu")


def launch_plan(args: argparse.Namespace, nproc: int, cfg=None):
    """The LaunchPlan of `train` / `launch` from their shared flags."""
    from disttrain.launch import LaunchPlan

    endpoint = args.rdzv_endpoint
    if args.master_port is not None and not 1 <= args.master_port <= 65535:
        raise ConfigError(f"--master-port {args.master_port}: give a port from 1 to 65535, e.g. 29500")
    if args.master_addr or args.master_port is not None:
        if endpoint:
            raise ConfigError("give either --rdzv-endpoint HOST:PORT or --master-addr/--master-port, not both")
        endpoint = f"{args.master_addr or '127.0.0.1'}:{29500 if args.master_port is None else args.master_port}"
    timing = {} if cfg is None else {"timeout_s": cfg.dist.timeout_s, "startup_timeout_s": cfg.dist.startup_timeout_s,
                                     "shutdown_grace_s": cfg.dist.shutdown_grace_s}
    plan = LaunchPlan(nproc=nproc, nnodes=str(args.nnodes), node_rank=args.node_rank, rdzv_endpoint=endpoint,
                      rdzv_id=args.rdzv_id, max_restarts=args.max_restarts, **timing)
    plan.check()
    return plan


def describe_plan(cfg: Config, plan) -> str:
    """World, layout, batch split, memory per rank and the launch command, as lines for a terminal."""
    from disttrain.launch import torchrun_argv
    from disttrain.memory import estimate
    from disttrain.parallel.mesh import layout_for

    nodes = int(plan.nnodes.split(":")[-1])
    world = cfg.dist.nproc * nodes
    layout = layout_for(cfg.parallel, world)
    d = cfg.data
    per_rank = d.global_batch_size // layout.data
    accumulation = per_rank // d.micro_batch_size if d.micro_batch_size else 1
    lines = [f"disttrain train --dry-run: nothing started, nothing written (run dir would be {cfg.run_dir})",
             f"world:      {world} rank(s) = {plan.nnodes} node(s) x {cfg.dist.nproc} process(es); launcher "
             f"{cfg.dist.launcher}",
             f"model:      {cfg.model.name}{_frozen(cfg)}; strategy {cfg.parallel.strategy}, precision "
             f"{cfg.parallel.precision}",
             f"layout:     {layout.describe()} (pipeline x data replicate x data shard x tensor)",
             f"batch:      {d.global_batch_size} sequences per step = {layout.data} data shard(s) x {per_rank} "
             f"= {accumulation} micro-batch(es) of {d.micro_batch_size or per_rank} x seq_len {cfg.model.seq_len}",
             f"steps:      {cfg.train.steps}" + (f" (stopping at {cfg.train.stop_at})" if cfg.train.stop_at else "")]
    try:
        est = estimate(cfg, world)
        total = est.total(cfg.parallel.activation_checkpointing)
        where = f" (rank {est.rank})" if est.rank is not None else ""
        parts = [f"parameters {_size(est.params)}", f"gradients {_size(est.grads)}",
                 f"optimizer {_size(est.optimizer)}"]
        if total is not None:
            parts += [f"activations {_size(total - est.params - est.grads - est.optimizer)}",
                      f"total {_size(total)}"]
        lines.append(f"memory:     per rank{where}: {', '.join(parts)} (estimate-memory compares the strategies)")
    except Exception as exc:  # an estimate the estimator cannot make never blocks the plan
        lines.append(f"memory:     no estimate ({exc})")
    if cfg.dist.launcher == "ray":
        lines.append(f"launch:     {world} Ray actors, {cfg.dist.ray_placement}, {cfg.dist.ray_cpus_per_worker:g} CPU "
                     f"and {cfg.dist.ray_gpus_per_worker:g} GPU each")
    elif world == 1 and plan.max_restarts == 0:
        lines.append("launch:     in this process (python -m disttrain.run CONFIG)")
    else:
        argv = torchrun_argv(plan, ["disttrain.run", str(cfg.run_dir / "config.toml")], cfg.run_dir / "logs", True)
        lines.append("launch:     torchrun " + shlex.join(argv))
    return "\n".join(lines)


def _frozen(cfg: Config) -> str:
    """How much model.freeze keeps from training ("" without it)."""
    if not cfg.model.freeze:
        return ""
    from disttrain.memory import frozen_share

    share = frozen_share(cfg.model)
    return " (model.freeze set)" if share is None else f" ({share:.0%} of its parameters frozen by model.freeze)"


def _size(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"
