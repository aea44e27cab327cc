"""Benchmark: peak host memory per rank while a Hugging Face model starts (built, sharded, loaded), per strategy.

    disttrain bench startup [--model hf:DIR] [--nproc 2] [--strategies fsdp,deepspeed:3,ddp,ddp+pp2] [--out DIR]

Without `--model` it first writes a Llama-family model of about 110 M parameters (random weights, fp32
safetensors, 8 layers x 1024 wide, vocabulary 8192) into `<out>/startup_model`. Each strategy is one launch; every
rank resets its peak resident set (`/proc/self/clear_refs`) once torch, transformers and the process group are up,
runs `create_backend` (meta build, strategy, materialisation, weights), and reports the rise of its peak resident
set (VmHWM) over the baseline once the model is materialised and sharded (when the optimizer factory is called),
against the full model's fp32 bytes, and after `create_backend` returns (DeepSpeed builds its ZeRO optimizer's
buffers there; torch optimizers allocate their state at the first step). Under fsdp a rank should hold its shards
plus one tensor at a time (target <= 0.6 at 2 ranks); ddp, which keeps a full replica, is the comparison. A
strategy may carry a layout, `+ppN` (pipeline stages: a rank reads and holds its own stages) and `+tpN`.
Results: `<out>/startup.json` and `<out>/startup.md`. Linux only (reads /proc).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from disttrain.errors import ArgumentParser, ConfigError, make_folder


def _args(argv):
    p = ArgumentParser(prog="disttrain bench startup", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="", help="hf:DIR (or DIR) of a saved Hugging Face model to start (default: "
                   "write a ~110M Llama)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--strategies", default="fsdp,deepspeed:3,ddp",
                   help="comma-separated; deepspeed:N is DeepSpeed at ZeRO stage N; +ppN / +tpN add a layout")
    p.add_argument("--strategy", default="", help=argparse.SUPPRESS)  # a worker's one strategy
    p.add_argument("--out", default="bench_results")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def write_model(directory: Path) -> None:
    """A Llama-family model with random weights, saved with save_pretrained (skipped when it exists)."""
    if (directory / "config.json").is_file():
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                         num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=256,
                         tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(directory)


def full_fp32_bytes(directory: Path) -> int:
    from disttrain.models.hf import SafetensorsReader, weight_files

    entries = SafetensorsReader(weight_files(directory)).entries.values()
    return sum(4 * math.prod(shape) for _, _, _, shape in entries)


def _local_numel(p) -> int:
    """Elements this rank holds of a parameter: an FSDP2 shard, a DeepSpeed ZeRO-3 partition, or all of it."""
    if hasattr(p, "to_local"):
        return p.to_local().numel()
    if hasattr(p, "ds_tensor"):
        return p.ds_tensor.numel()
    return p.numel()


def _file_name(strategy: str) -> str:
    return strategy.replace(":", "_").replace("+", "_")


def _worker(args) -> None:
    import torch

    from disttrain.backend import create_backend
    from disttrain.config import load_config
    from disttrain.models import build_model
    from disttrain.optim import optimizer_factory
    from disttrain.runtime import exit_process, init_runtime, shutdown

    name, *layout = args.strategy.split("+")
    strategy, _, stage = name.partition(":")
    axes = {"pp": "parallel.pipeline", "tp": "parallel.tensor"}
    cfg = load_config(None, [f"model.name={args.model}", f"parallel.strategy={strategy}", "dist.threads_per_rank=1",
                             *([f"parallel.deepspeed_stage={stage}"] if stage else []),
                             *(f"{axes[flag[:2]]}={flag[2:]}" for flag in layout)])
    runtime = init_runtime(cfg.dist, always_form_group=True)
    import transformers

    from disttrain.models.hf import hf_directory

    config = transformers.AutoConfig.from_pretrained(hf_directory(args.model))
    transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # imports its code: not the model
    baseline = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
    torch.manual_seed(0)
    model = build_model(cfg.model)
    at_model = []

    def factory(m):  # called once the model is materialised and sharded, before any optimizer state exists
        at_model.append(_status_kib("VmHWM"))
        return optimizer_factory(cfg.optim)(m)

    backend = create_backend(model, factory, cfg.parallel, runtime=runtime)
    peak = _status_kib("VmHWM")
    held = sum(_local_numel(p) for p in backend.model.parameters()) * 4
    row = {"strategy": args.strategy, "world": runtime.world_size, "rank": runtime.rank,
           "peak_rise_bytes": (at_model[0] - baseline) * 1024, "with_optimizer_bytes": (peak - baseline) * 1024,
           "parameter_bytes_held": held,
           "weight_bytes_read": model.disttrain_weights.bytes_read}
    (Path(args.out) / f"startup_{_file_name(args.strategy)}_rank{runtime.rank}.json").write_text(json.dumps(row))
    shutdown(runtime)
    exit_process(0)


def _check_strategies(args) -> None:
    """Each --strategies entry: a strategy (deepspeed:STAGE for DeepSpeed's ZeRO stage) with +ppN / +tpN layouts;
    one line before the model is written or a worker starts."""
    from disttrain.parallel import registry

    entries = [s for s in args.strategies.split(",") if s]
    if not entries or len(entries) != len(args.strategies.split(",")):
        raise ConfigError(f"--strategies {args.strategies!r}: name strategies separated by commas, e.g. fsdp,ddp+pp2")
    for strategy in entries:
        name, *flags = strategy.split("+")
        base, _, stage = name.partition(":")
        if base not in [*registry.names(), *registry.aliases()] or (
                stage and not (base == "deepspeed" and stage in ("0", "1", "2", "3"))):
            raise ConfigError(f"--strategies {strategy!r}: {name!r} is not a strategy; use one of "
                              f"{', '.join(registry.names())} (deepspeed:0..3 for a ZeRO stage)")
        for flag in flags:
            if flag[:2] not in ("pp", "tp") or not flag[2:].isdigit() or int(flag[2:]) < 1:
                raise ConfigError(f"--strategies {strategy!r}: a layout is +ppN or +tpN (e.g. ddp+pp2), not +{flag}")


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    if args.worker:
        _worker(args)
        return 0
    from disttrain.bench import check_numbers, worker_entry
    from disttrain.launch import launch

    check_numbers(("--nproc", args.nproc, 1))
    _check_strategies(args)
    from disttrain.models.hf import hf_directory

    if args.model:
        given = args.model
        args.model = given if given.startswith("hf:") else f"hf:{given}"
        try:
            hf_directory(args.model)
        except ConfigError as exc:
            raise ConfigError(f"--model {given}: {exc}") from None
    out = make_folder(Path(args.out).resolve(), "--out")
    if not args.model:
        write_model(out / "startup_model")
        args.model = f"hf:{out / 'startup_model'}"

    full = full_fp32_bytes(hf_directory(args.model))
    rows = []
    for strategy in args.strategies.split(","):
        args.strategy = strategy
        code = launch(args.nproc, worker_entry("disttrain.bench.startup", args), out / "startup_run")
        if code:
            return code
        for path in sorted(out.glob(f"startup_{_file_name(strategy)}_rank*.json")):
            rows.append(json.loads(path.read_text()))
            path.unlink()
    lines = [f"# Start-up peak memory per rank: {args.model}, {args.nproc} ranks, CPU\n",
             f"Full model, fp32: {full / 2**20:.1f} MiB.\n",
             "| strategy | rank | peak rise at model start MiB | / full fp32 | with the optimizer built MiB | "
             "parameters held MiB | weights read MiB |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        r["ratio"] = r["peak_rise_bytes"] / full
        lines.append(f"| {r['strategy']} | {r['rank']} | {r['peak_rise_bytes'] / 2**20:.1f} | {r['ratio']:.3f} | "
                     f"{r['with_optimizer_bytes'] / 2**20:.1f} | {r['parameter_bytes_held'] / 2**20:.1f} | "
                     f"{r['weight_bytes_read'] / 2**20:.1f} |")
    lines.append("")
    for strategy in dict.fromkeys(r["strategy"] for r in rows):
        worst = max(r["ratio"] for r in rows if r["strategy"] == strategy)
        target = " (target <= 0.6)" if strategy == "fsdp" else ""
        lines.append(f"- {strategy}: worst rank **{worst:.3f}** x the full fp32 weights at model start{target}")
    markdown = "\n".join(lines) + "\n"
    (out / "startup.json").write_text(json.dumps({"model": args.model, "full_fp32_bytes": full, "rows": rows},
                                                 indent=1))
    (out / "startup.md").write_text(markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    main(sys.argv[1:])
