"""`disttrain verify`: does your job give the same numbers under every strategy as in one process?

    disttrain verify [CONFIG] [--set k=v ...] [--strategies ddp,zero2,fsdp,hsdp,tp2,pp2,fsdp+tp2] --nproc 2 --steps 10

Runs your config for K steps in one process (the reference) and then, in one torchrun launch of N ranks,
under each strategy in turn (one process group, so start-up is paid once). Prints, per strategy, the max
|loss difference|, the max relative difference of the gradient norm and the max |difference| of the final
parameters, and exits 1 if any exceeds the tolerance. The default is every registered strategy that runs on a
process group and can run this config, and the model split over all N ranks (`tpN`: tensor parallel, `ppN`: a
pipeline of N stages, `cpN`: each sequence over N ranks) where the model allows it; a strategy registered by your
own module (`disttrain.parallel.register`) is verified too: its module is imported in the workers. Runs go to
`RUN_DIR/verify/`.

An entry is a strategy, a layout, or both joined by `+`: `tp2`, `pp2`, `fsdp+tp2` (data axis fsdp, tensor 2),
`ddp+pp2+gpipe`, `tp2+sp` (sequence parallel), `fsdp+cp2` (context parallel); a pipeline's schedule is one of
parallel.pipeline_schedule's values.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import re
import sys
from pathlib import Path

from disttrain.config import Config, ConfigError, load_config, save_config, strategies_for, validate
from disttrain.errors import make_folder


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="TOML config file (default: the built-in job)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--strategies", default="", help="comma-separated strategies and layouts, e.g. "
                        "ddp,fsdp,tp2,pp2,fsdp+tp2 (default: every registered strategy that runs on a process group "
                        "and can run the config, and tpN / ppN over all N ranks where the model allows)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks for the distributed runs")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per run")
    parser.add_argument("--tolerance", type=float, default=1e-5,
                        help="max allowed |loss difference|, relative grad-norm difference and |parameter difference|")


SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv", "dualpipev")


def _job(cfg: Config, steps: int, out: Path, name: str, entry: str, nproc: int) -> Config:
    """`cfg` for K steps under `entry` (a strategy, a layout such as `tp2` / `pp2+gpipe`, or both: `fsdp+tp2`)."""
    job = copy.deepcopy(cfg)
    job.train.steps, job.train.stop_at, job.train.eval_every = steps, 0, 0
    job.checkpoint.every, job.checkpoint.resume, job.log.progress = 0, "never", False
    job.run.out_dir, job.run.name = str(out), name
    job.dist.nproc = nproc
    p = job.parallel
    for i, part in enumerate(entry.split("+")):
        degree = re.fullmatch(r"(tp|pp|cp)(\d+)", part)
        if degree:
            setattr(p, {"tp": "tensor", "pp": "pipeline", "cp": "context"}[degree[1]], int(degree[2]))
        elif part == "sp":
            p.sequence_parallel = True
        elif part in SCHEDULES:
            p.pipeline_schedule = part
        elif i == 0:
            from disttrain.parallel import registry

            p.strategy = registry.canonical(part)
        else:
            raise ConfigError(f"verify --strategies: {part!r} in {entry!r} is not tpN, ppN, cpN, sp or a pipeline "
                              f"schedule ({', '.join(SCHEDULES)}); e.g. 'fsdp+tp2' or 'pp2+gpipe'")
    return job


def _layouts(cfg: Config, nproc: int) -> list[str]:
    """The model split over all ranks, tensor-wise, stage-wise and sequence-wise, where the config allows it."""
    out = []
    for entry in (f"tp{nproc}", f"pp{nproc}", f"cp{nproc}"):
        try:
            validate(_job(cfg, 1, Path("."), entry, entry, nproc), gpu_count=nproc, world=nproc)
        except ConfigError:
            continue
        out.append(entry)
    return out


def run(args: argparse.Namespace) -> int:
    import torch

    from disttrain.parallel import registry

    cfg = load_config(args.config, args.overrides)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if args.steps < 1 or args.nproc < 1:
        raise ConfigError("verify: --steps and --nproc must be >= 1")
    if not 0 <= args.tolerance < math.inf:
        raise ConfigError(f"verify --tolerance {args.tolerance:g}: give a finite difference >= 0, e.g. 1e-5")
    if args.strategies.strip() and not strategies:
        raise ConfigError(f"verify --strategies {args.strategies!r} names none; leave it out for every strategy "
                          "that can run the config, or name some, e.g. ddp,fsdp")
    if not strategies:
        strategies = [s for s in strategies_for(cfg, args.nproc) if registry.get(s).needs_group]
        strategies += _layouts(cfg, args.nproc) if args.nproc > 1 else []
    if not strategies:
        raise ConfigError(f"verify: no strategy can run this config on {args.nproc} ranks (the reference would run "
                          "alone); name one with --strategies to see why, e.g. --strategies ddp")
    out = cfg.run_dir / "verify"
    jobs = {s: _job(cfg, args.steps, out, s, s, args.nproc) for s in strategies}
    reference = _job(cfg, args.steps, out, "single", "single", 1)
    for job in [reference, *jobs.values()]:
        validate(job, gpu_count=torch.cuda.device_count())  # every problem before anything starts
    make_folder(out, "run.out_dir / run.name")
    for name, job in jobs.items():
        save_config(job, out / name / "config.toml")

    from safetensors.torch import load_file

    from disttrain.launch import launch
    from disttrain.trainer import Trainer

    print(f"disttrain verify: reference run (1 process, {args.steps} steps)", file=sys.stderr)
    single = _record(Trainer(reference), out, "single")
    modules = {registry.get(job.parallel.strategy).apply.__module__ for job in jobs.values()
               if job.parallel.strategy != "auto"}
    imports = sorted(m for m in modules if not m.startswith("disttrain."))
    code = launch(args.nproc, ["disttrain.cli.verify", str(out), ",".join(imports), *strategies], out)
    if code != 0:
        return code
    results = json.loads((out / "results.json").read_text())
    params = {}
    for name in ["single", *results]:  # a pipeline's stages wrote their parts apart
        params[name] = {k: v for part in sorted((out / name).glob("final*.safetensors")) for k, v in
                        load_file(part).items()}
    return _report(single, params, results, args.tolerance)


def _record(trainer, out: Path, name: str) -> dict[str, list[float]]:
    """Train; rank 0 writes the final parameters to OUT/NAME/final.safetensors; returns losses and grad norms."""
    from safetensors.torch import save_file

    result = trainer.fit()
    weights = {}
    for key, value in trainer.backend.state_dict()["model"].items():  # every rank: a collective when sharded
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        weights[key] = full.detach().to("cpu", copy=True).float().contiguous()  # tied weights: separate copies
    if trainer.backend.runtime.is_main_process():
        save_file(weights, out / name / "final.safetensors")
    elif trainer.backend.prepared.local_state:  # a pipeline stage: this rank's own parameters
        save_file(weights, out / name / f"final.rank{trainer.backend.runtime.rank}.safetensors")
    return {"losses": result.losses, "grad_norms": result.grad_norms}


def _report(single: dict, params: dict, results: dict[str, dict], tolerance: float) -> int:
    print(f"{'strategy':<16} {'steps':>5} {'max |loss diff|':>16} {'grad norm (rel)':>16} {'params':>10} "
          f"{'final loss':>11}  verdict")
    print(f"{'single':<16} {len(single['losses']):>5} {'(reference)':>16} {'':>16} {'':>10} "
          f"{single['losses'][-1]:>11.6f}")
    failed = 0
    for name, run in results.items():
        loss = max(abs(a - b) for a, b in zip(run["losses"], single["losses"], strict=True))
        norm = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(run["grad_norms"], single["grad_norms"],
                                                                   strict=True))
        param = max((params[name][k] - ref).abs().max().item() for k, ref in params["single"].items())
        ok = loss <= tolerance and norm <= tolerance and param <= tolerance  # False for NaN too
        failed += not ok
        print(f"{name:<16} {len(run['losses']):>5} {loss:>16.3e} {norm:>16.3e} {param:>10.3e} "
              f"{run['losses'][-1]:>11.6f}  {'ok' if ok else f'DIFFERS (tolerance {tolerance:g})'}")
    return 1 if failed else 0


def _worker(out: Path, imports: list[str], strategies: list[str]) -> None:
    """One rank: train every strategy's job in turn on one process group; rank 0 writes the losses and grad
    norms (OUT/results.json) and each strategy's final parameters. `imports`: the modules that register
    strategies of the user's own."""
    import importlib

    from disttrain.parallel import registry
    from disttrain.runtime import init_runtime, shutdown
    from disttrain.trainer import Trainer

    for module in imports:  # a module of your own exports SPECS, like the built-in strategy modules
        for spec in importlib.import_module(module).SPECS:
            registry.register(spec)

    runtime, results = None, {}
    for name in strategies:
        job = load_config(out / name / "config.toml")
        runtime = runtime or init_runtime(job.dist, always_form_group=True)
        results[name] = _record(Trainer(job, runtime=runtime), out, name)
    if runtime.is_main_process():
        (out / "results.json").write_text(json.dumps(results))
    shutdown(runtime)


def main(argv: list[str]) -> None:
    """The worker's entry: OUT, the comma-separated imports, then the strategies' names."""
    from disttrain.runtime import exit_process

    _worker(Path(argv[0]), [m for m in argv[1].split(",") if m], argv[2:])
    exit_process(0)


if __name__ == "__main__":
    main(sys.argv[1:])
