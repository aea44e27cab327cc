"""`disttrain train --dry-run`: what a job would do, from its validated config; nothing starts, nothing is written."""

from __future__ import annotations

import shlex

from disttrain.config import Config


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
