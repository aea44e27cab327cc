"""Command line: argument parsing only; the work happens in launch, trainer and bench.

    disttrain train [CONFIG] [--nproc N] [--resume auto|never|PATH] [--set section.key=value ...]
    disttrain launch [--nproc N] SCRIPT [ARGS ...]
    disttrain ckpt list|verify|export ...      inspect, check and export checkpoints
    disttrain config [CONFIG] [--set ...]      print the resolved config (or --list: every setting)
    disttrain verify [CONFIG] --strategies ... one job under several strategies vs the 1-process reference
    disttrain estimate-memory [CONFIG] --world-size N [--strategy S] [--budget-gib G]
    disttrain deepspeed-config [CONFIG] [--set ...] [--nproc N] -o ds.json   the DeepSpeed JSON of a config
    disttrain env                              versions, devices, backends, detected launcher
    disttrain status RUN_DIR [--dump]          where each rank is; --dump: its stack and the collective it waits in
    disttrain completion bash|zsh              a shell completion script (eval "$(disttrain completion bash)")
    disttrain plot RUN_DIR [RUN_DIR ...] [--out DIR]   loss, lr, tokens/s, MFU, memory, communication as PNG
    disttrain bench overhead|scaling|comm|predict|pipeline|loss-parallel|checkpoint|memory|service|wire|
                    weight-sync|startup|data|gpu
                                               figures (see --help)
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path

from disttrain.cli.plan import describe_plan, launch_arguments, launch_plan, nproc_of
from disttrain.config import ConfigError, describe, dumps_toml, load_config, save_config
from disttrain.errors import ArgumentParser, exit_code, make_folder


def _parser() -> argparse.ArgumentParser:
    from disttrain._version import __version__

    parser = ArgumentParser(prog="disttrain", description="Distributed PyTorch training.")
    parser.add_argument("--version", action="version", version=f"disttrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a config (default: the built-in GPT job)")
    train.add_argument("config", nargs="?", help="config file: TOML, YAML (.yaml/.yml) or JSON")
    launch_arguments(train, nproc_default=None)
    train.add_argument("--launcher", choices=["torchrun", "ray"],
                       help="torchrun (this node's processes, default) or ray (Ray actors; sets dist.launcher)")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override one setting, e.g. --set optim.lr=1e-3 (repeatable)")
    train.add_argument("--resume", help="auto (default: newest committed checkpoint), never, or a checkpoint folder "
                       "(sets checkpoint.resume)")
    train.add_argument("--dry-run", action="store_true",
                       help="validate and print the plan (world, layout, batch split, memory per rank, the torchrun "
                            "command); start nothing")

    ckpt = sub.add_parser("ckpt", help="list, verify or export checkpoints")
    ckpt_sub = ckpt.add_subparsers(dest="ckpt_command", required=True)
    ckpt_sub.add_parser("list", help="committed checkpoints of a run").add_argument("path", help="RUN_DIR")
    ckpt_sub.add_parser("verify", help="check commit markers and checksums").add_argument(
        "path", help="RUN_DIR, its checkpoints/ folder, or one step_<N> folder")
    export = ckpt_sub.add_parser("export", help="consolidated model weights for inference")
    export.add_argument("path", help="a step_<N> folder")
    export.add_argument("out", help="OUT.safetensors (--format safetensors) or a new folder (--format hf)")
    export.add_argument("--format", choices=["safetensors", "hf"], default="safetensors",
                        help="safetensors: one file, every weight name; hf: a Hugging Face model folder "
                             "(config.json + sharded safetensors) that from_pretrained loads")
    export.add_argument("--max-shard-size", default="5GB", help="--format hf: largest shard file (5GB, 500MB, 2GiB)")
    export.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                        help="dtype of the floating-point weights written")
    export.add_argument("--force", action="store_true", help="replace an existing OUT")

    launch = sub.add_parser("launch", help="run your own training script on N processes through torchrun")
    launch_arguments(launch, nproc_default="1")
    launch.add_argument("--run-dir", default="runs/launch", help="where torchrun's logs go")
    launch.add_argument("-m", dest="module", action="store_true", help="SCRIPT is a module name (python -m SCRIPT)")
    launch.add_argument("--fork", action="store_true",
                        help="fork the ranks from a server that imported torch once (about 3 s of CPU less per rank "
                             "and launch); variables SCRIPT sets for torch before importing it (CUDA_VISIBLE_DEVICES) "
                             "then come too late")
    launch.add_argument("script")
    launch.add_argument("args", nargs=argparse.REMAINDER)

    config = sub.add_parser("config", help="print the resolved config, or every setting with --list")
    config.add_argument("config", nargs="?")
    config.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    config.add_argument("--list", action="store_true", help="every setting with its type, default and meaning")

    sub.add_parser("env", help="versions, devices, backends and the detected launcher")

    status = sub.add_parser("status", help="where each rank of a job is (step, phase, heartbeat); --dump: also its "
                                           "stack and the collective it waits in")
    status.add_argument("run_dir", metavar="RUN_DIR", help="the job's run folder")
    status.add_argument("--dump", action="store_true", help="ask this machine's live ranks for their Python stacks "
                        "and their flight recorder's collectives (the job goes on)")

    plot = sub.add_parser("plot", help="draw runs' metrics.jsonl (loss, lr, tokens/s, MFU, memory, communication)")
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run folders; several are overlaid")
    plot.add_argument("--out", help="folder for the PNG files (default: the first RUN_DIR/plots)")

    mem = sub.add_parser("estimate-memory", help="per-rank memory of a config under every strategy")
    mem.add_argument("config", nargs="?")
    mem.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    mem.add_argument("--world-size", type=int, default=2, help="ranks to estimate for")
    mem.add_argument("--strategy", help="one strategy (default: all of them, side by side)")
    mem.add_argument("--budget-gib", type=float, help="say which strategies fit this much memory per rank")

    ds = sub.add_parser("deepspeed-config", help="write the DeepSpeed JSON that the deepspeed strategy runs with")
    ds.add_argument("config", nargs="?")
    ds.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ds.add_argument("--nproc", type=int, help="world size the batch keys are computed for (default: dist.nproc)")
    ds.add_argument("-o", "--output", required=True, help="where to write the JSON, e.g. ds.json")

    from disttrain.cli.verify import add_arguments

    add_arguments(sub.add_parser("verify", help="the same job under several strategies vs 1 process"))

    completion = sub.add_parser("completion", help="a shell completion script: eval \"$(disttrain completion bash)\"")
    completion.add_argument("shell", choices=["bash", "zsh"])

    bench = sub.add_parser("bench", help="benchmarks that print and save their figures")
    bench.add_argument("name", choices=["overhead", "checkpoint", "memory", "service", "wire", "startup", "data", "gpu",
                                        "scaling", "comm", "predict", "pipeline", "loss-parallel", "weight-sync"])
    bench.add_argument("args", nargs=argparse.REMAINDER, help="passed to the benchmark (see its --help)")
    return parser


def _prepare_train(args: argparse.Namespace):
    """Load, override, validate and resolve the config; nothing has started yet when this raises."""
    cfg = load_config(args.config, args.overrides)
    if args.nproc is not None:
        cfg.dist.nproc = nproc_of(args.nproc)
    if args.launcher is not None:
        cfg.dist.launcher = args.launcher
    if args.resume is not None:
        cfg.checkpoint.resume = args.resume
    import torch

    from disttrain.config import validate

    plan = launch_plan(args, cfg.dist.nproc, cfg)
    if cfg.dist.launcher == "ray" and not plan.single_node:
        raise ConfigError(f"--nnodes {plan.nnodes} with --launcher ray: Ray places the ranks on its nodes itself; "
                          "drop --nnodes and --rdzv-endpoint (choose nodes with dist.ray_placement or resources)")
    low, _, high = plan.nnodes.partition(":")
    for nodes in range(int(low), int(high or low) + 1):  # elastic: every membership must be valid
        validate(cfg, gpu_count=torch.cuda.device_count(), world=cfg.dist.nproc * nodes)
    if cfg.model.name != "gpt":
        from disttrain.models import resolve_factory

        resolve_factory(cfg.model.name)  # import errors surface here, before any worker starts
    if cfg.model.freeze:
        from disttrain.memory import frozen_share

        frozen_share(cfg.model)  # its patterns are matched on the meta device, before any worker starts
    if cfg.data.tokenizer:
        from disttrain.corpus import check_source
        from disttrain.models import vocab_size

        # the tokenizer loads and fits the model's vocabulary, before any worker starts or anything is written
        check_source(cfg.data.source, cfg.data.tokenizer, cfg.data.text_field, vocab_size(cfg.model))
    from disttrain.parallel import registry

    cfg.parallel.strategy = registry.resolve(cfg.parallel.strategy, cfg.dist.nproc * int(high or low)).name
    return cfg, plan


def cmd_train(args: argparse.Namespace) -> int:
    cfg, plan = _prepare_train(args)
    if args.dry_run:
        print(describe_plan(cfg, plan))
        return 0
    config_path = make_folder(cfg.run_dir, "run.out_dir / run.name") / "config.toml"
    save_config(cfg, config_path)
    if cfg.dist.launcher == "ray":
        from disttrain.launch_ray import launch_ray

        return launch_ray(cfg, config_path, plan.max_restarts)
    if plan.nproc == 1 and plan.single_node and plan.max_restarts == 0:
        from disttrain.trainer import Trainer

        print(f"disttrain: training {cfg.model.name} on 1 process; run dir {cfg.run_dir}", file=sys.stderr)
        Trainer(cfg).fit()  # Preempted, out of memory, ...: main() prints the line and returns the code
        return 0
    from disttrain.launch import launch

    total = (cfg.train.stop_at or cfg.train.steps) if cfg.log.progress else 0
    return launch(plan, ["disttrain.run", str(config_path)], cfg.run_dir, progress_total=total)


def cmd_ckpt(args: argparse.Namespace) -> int:
    import disttrain.cli.ckpt

    if args.ckpt_command == "export":
        return disttrain.cli.ckpt.export(Path(args.path), Path(args.out), format=args.format,
                                         max_shard_size=args.max_shard_size, dtype=args.dtype, force=args.force)
    return getattr(disttrain.cli.ckpt, args.ckpt_command)(Path(args.path))


def cmd_launch(args: argparse.Namespace) -> int:
    nproc = nproc_of(args.nproc)
    if nproc < 1:
        raise ConfigError(f"--nproc {args.nproc}: must be >= 1")
    if args.module:
        import importlib.util

        try:
            found = importlib.util.find_spec(args.script) is not None
        except (ImportError, ValueError):  # a parent package missing, an empty or relative name
            found = False
        if not found:
            raise ConfigError(f"-m {args.script}: no such module; check the name and PYTHONPATH")
    elif not Path(args.script).is_file():
        raise ConfigError(f"script '{args.script}' not found; pass the path of your training script (or -m MODULE)")
    from disttrain.launch import launch

    plan = launch_plan(args, nproc)
    make_folder(Path(args.run_dir), "--run-dir")
    return launch(plan, [args.script, *args.args], Path(args.run_dir), module=args.module,
                  fork=args.fork)


def cmd_config(args: argparse.Namespace) -> int:
    if args.list:
        for key, typ, default, doc in describe():
            print(f"{key} ({typ}, default {default!r}): {doc}")
        return 0
    import torch

    from disttrain.config import validate

    cfg = load_config(args.config, args.overrides)
    validate(cfg, gpu_count=torch.cuda.device_count())  # print only a config that can run
    print(dumps_toml(cfg), end="")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from disttrain.cli.verify import run

    return run(args)


def cmd_estimate_memory(args: argparse.Namespace) -> int:
    from disttrain.config import strategies_for, validate
    from disttrain.memory import report

    cfg = load_config(args.config, args.overrides)
    if args.world_size < 1:
        raise ConfigError(f"--world-size {args.world_size}: must be >= 1")
    if args.budget_gib is not None and not 0 < args.budget_gib < math.inf:
        raise ConfigError(f"--budget-gib {args.budget_gib:g}: give a device's memory in GiB > 0, e.g. 80")
    cfg.dist.nproc = args.world_size
    if args.strategy:
        cfg.parallel.strategy = args.strategy
        validate(cfg, gpu_count=args.world_size, world=args.world_size)  # GPUs assumed: this is a plan
        strategies = [cfg.parallel.strategy]
    else:  # every registered strategy that can run this config, side by side
        strategies = strategies_for(cfg, args.world_size)
        if not strategies:
            validate(cfg, gpu_count=args.world_size, world=args.world_size)  # says what is wrong
    print(report(cfg, args.world_size, strategies, args.budget_gib))
    return 0


def cmd_deepspeed_config(args: argparse.Namespace) -> int:
    from disttrain.config import validate_model
    from disttrain.memory import param_shapes
    from disttrain.parallel.deepspeed.config import DeepSpeedConfig

    cfg = load_config(args.config, args.overrides)
    world = cfg.dist.nproc if args.nproc is None else args.nproc
    if world < 1:
        raise ConfigError(f"--nproc {world}: must be >= 1")
    validate_model(cfg)  # (the rest is DeepSpeed's: from_config checks it against the JSON's keys)
    if Path(args.output).is_dir():
        raise ConfigError(f"-o {args.output} is a folder; give the path of the JSON file to write")
    numel = sum(math.prod(shape) for shape in param_shapes(cfg.model))
    plan = DeepSpeedConfig.from_config(cfg, world, numel)  # (every disagreement with a user JSON, before writing)
    make_folder(Path(args.output).parent, "-o")
    try:
        plan.save_config(args.output)
    except OSError as exc:
        raise ConfigError(f"-o {args.output}: cannot write it ({exc.strerror}); give a path you can write") from None
    print(f"disttrain: wrote {args.output} (ZeRO stage {cfg.parallel.deepspeed_stage}, {world} ranks)",
          file=sys.stderr)
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    from disttrain.cli.env import env_report

    for key, value in env_report().items():
        print(f"{key + ':':<22} {value}")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from disttrain.cli.plot import run

    return run(args.run_dirs, args.out)


def cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    return importlib.import_module(f"disttrain.bench.{args.name.replace('-', '_')}").main(args.args)


def cmd_status(args: argparse.Namespace) -> int:
    from disttrain.watchdog import report

    print(report(Path(args.run_dir), args.dump))
    return 0


def cmd_completion(args: argparse.Namespace) -> int:
    from disttrain.cli.completion import script

    print(script(_parser(), args.shell), end="")
    return 0


COMMANDS = {"completion": cmd_completion,
            "train": cmd_train, "ckpt": cmd_ckpt, "launch": cmd_launch, "config": cmd_config, "env": cmd_env,
            "verify": cmd_verify, "estimate-memory": cmd_estimate_memory, "bench": cmd_bench,
            "deepspeed-config": cmd_deepspeed_config, "plot": cmd_plot, "status": cmd_status}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="disttrain: %(message)s")
    try:
        code = COMMANDS[args.command](args)
    except Exception as exc:
        code = exit_code(exc)  # one line and its exit code, or the traceback of a bug
    if argv is None:
        if "torch.distributed" in sys.modules:  # see exit_process: gloo threads can abort at interpreter exit
            from disttrain.runtime import exit_process

            exit_process(code)
        sys.exit(code)
    return code


if __name__ == "__main__":
    main()
