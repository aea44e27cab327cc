"""Benchmark: predicted step time, tokens/s per GPU and scaling efficiency of a data-parallel strategy (with a tensor
split, a pipeline or a context split where the job has one) at GPU counts this machine does not have, from one
device's compute time and an alpha-beta model of the interconnect.

    disttrain bench predict [CONFIG] [--set ...] [--model llama3-8b] [--strategy ddp,fsdp] [--gpus 8,64,512,1024]
        [--interconnect h100-nvlink+ib-ndr | measured:DIR/comm_fit.json] [--compute-s S | --tflops T --mfu M]
        [--local-batch B | --nodes N] [--micro-batch M] [--precision bf16-mixed] [--sweep KEY=V1,V2]
        [--out bench_results]
    disttrain bench predict --validate [CONFIG] [--set ...] [--measured DIR/scaling.csv
        --interconnect measured:DIR/comm_fit.json]
    disttrain bench predict --measure [CONFIG] [--set ...] [--world-sizes 1,2,3] [--strategies ddp,fsdp]
    disttrain bench predict --measure --validate [CONFIG] [--set ...] [--rounds 3] [--world-sizes 1,2,3]

The model (scale_model.py, on interconnect.py's links; docs/architecture.md "The scale model"): compute of one step
on one device, measured (`--compute-s`) or FLOPs / (peak x MFU) with FLOPs per token = 6 x params + 12 x layers x
d_model x seq (a config's model: counted from its modules, `perf.flops_by_unit`, frozen parameters' gradients left
out); plus each strategy's collectives (ring / hierarchical alpha-beta times) overlapped with the compute they can
hide behind. Without `--model` the job of CONFIG / `--set` is modelled (predict_job.py): its model counted from its
module tree built on the meta device (`model.freeze` included); the strategy it runs on several ranks, unless
`--strategy` names others; its batch per GPU, `data.global_batch_size` over `dist.nproc` x `--nodes` (dist.nproc is
one node's ranks; the nodes are a launch's; under `parallel.tensor` / `parallel.pipeline` / `parallel.context`, per
group of tensor x pipeline x context GPUs, which read one batch), accumulated in micro-batches of
`data.micro_batch_size` (`--local-batch` and `--micro-batch` override both); its gradient compression, DDP buckets,
logged lines, tensor split (its collectives recorded from disttrain's plan: tensor_calls.py), pipeline (disttrain's
stage split and schedule) and context split (each attention's keys and values: model_split.context_calls). With
`--model`, the preset with the config's settings. `--sweep KEY=V1,V2` forecasts each value of a setting that changes
the collectives or the splits (`FORECAST_SWEEPS`: gradient compression, PowerSGD's rank, DDP's buckets, the logged
lines, the tensor, pipeline and context degrees and the schedules) in one table (predict_forecast.py). Writes
`<out>/predict.md` and `predict.csv`.

`--validate` checks the model (predict_validate.py): (i) with `--measured` (the CSV of `disttrain bench scaling`, or
of `--measure`, or a minimal one with the columns strategy, world_size, step_time_s; its `params` and
`trained_params`, where given, must be the model's; a series of `bench scaling --sweep` is predicted with its swept
setting) and a comm_fit.json from `disttrain bench comm` on the same machine (on a CPU machine whose cores all run
ranks, `--busy step`: each call timed after a phase of compute, as a step issues it): every N-rank step time
predicted from the 1-rank one (error %, target <= 10%); (ii) published scaling (torchtitan's Llama 3 8B FSDP, the
PyTorch DDP paper's weak scaling): predicted vs published efficiency. `--measure` writes `<out>/scaling.csv` from
this machine (predict_measure.py). `--measure --validate` does (i) in one sitting: `--rounds` rounds of the step
times and a `bench comm --busy step` fit over the sizes the step sends, pooled, then checked
(predict_measure.sitting): the way to take figure (i)."""

from __future__ import annotations

import argparse
import csv
import json
from dataclasses import replace
from pathlib import Path

from disttrain.bench import check_numbers, integers
from disttrain.bench.interconnect import PRESETS, Interconnect, interconnect_from_fit, with_gpus_per_node
from disttrain.bench.model_shapes import MODELS, ModelShape
from disttrain.bench.predict_forecast import (
    FORECAST_SWEEPS,
    LOCAL_BATCH,
    cpu_cores,
    forecast,
    report_date,
    report_footer,
)
from disttrain.bench.predict_job import (
    counted_shape,
    wire_dtypes,
)
from disttrain.bench.predict_validate import measured_checks, published_checks
from disttrain.bench.scale_model import (
    BYTES,
    STRATEGIES,
    canonical_strategy,
)
from disttrain.config import Config
from disttrain.errors import ArgumentParser, ConfigError, make_folder

DEFAULT_NET = "h100-nvlink+ib-ndr"

def _args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(prog="disttrain bench predict", description=__doc__.split("\n")[0])
    p.add_argument("config", nargs="?", help="TOML config of the model (default: the built-in job)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--model", default="", help="a preset instead of the config's model: " + ", ".join(MODELS))
    p.add_argument("--strategy", default="", help="comma-separated: " + ", ".join(STRATEGIES) + " (zero3 = fsdp; "
                   "default: fsdp with --model, else what the config's parallel.strategy runs on several ranks: auto "
                   "= ddp, DeepSpeed by its stage)")
    p.add_argument("--gpus", default="8,64,512,1024", help="GPU counts, comma-separated")
    p.add_argument("--interconnect", default="",
                   help=", ".join(PRESETS) + ", or measured:PATH (comm_fit.json of `disttrain bench comm`); default "
                   f"{DEFAULT_NET} (a sitting, --measure --validate, measures its own)")
    p.add_argument("--gpus-per-node", type=int, default=0, help="override the interconnect's devices per node")
    p.add_argument("--compute-s", type=float, default=0.0, help="seconds of one step's compute on one device (under "
                   "a pipeline the whole model's; under a tensor split one rank's, under a context split its last "
                   "rank's: what --measure --world-sizes 1 times)")
    p.add_argument("--tflops", type=float, default=0.0, help="peak TFLOP/s (default: the H100 SXM's dense peak in "
                   "the precision's matmul dtype: 989 in bf16 / fp16, 67 in fp32)")
    p.add_argument("--mfu", type=float, default=0.35, help="model FLOPs utilisation of one device")
    p.add_argument("--local-batch", type=int, default=0, help="sequences per GPU per step (default: the preset's, or "
                   "the config's data.global_batch_size / (dist.nproc x --nodes)); --measure: per rank, accumulated "
                   "in --micro-batch (default: one micro-batch)")
    p.add_argument("--nodes", type=int, default=1, help="nodes the config's job runs on (a launch's --nnodes: "
                   "dist.nproc is one node's ranks), for its batch per GPU")
    p.add_argument("--micro-batch", type=int, default=0,
                   help="sequences per forward pass: the batch per GPU / this = accumulation (default: the config's "
                        "data.micro_batch_size; none with --model or --local-batch); --measure: per rank")
    p.add_argument("--precision", default="", help="one of " + ", ".join(BYTES) + " (default: the config's, or "
                   "bf16-mixed for --model)")
    p.add_argument("--sweep", default="", help="KEY=V1,V2,...: forecast each value (one of "
                   + ", ".join(FORECAST_SWEEPS) + ")")
    p.add_argument("--cpu-cores", type=int, default=-1,
                   help="cores ranks share on a CPU machine (default: this machine's with a CPU comm fit, else 0)")
    p.add_argument("--validate", action="store_true", help="check the model (see the module help)")
    p.add_argument("--measured", default="", help="--validate: scaling.csv measured on this machine")
    p.add_argument("--measure", action="store_true", help="measure weak scaling here, write <out>/scaling.csv")
    p.add_argument("--world-sizes", default="1,2,3", help="--measure: world sizes")
    p.add_argument("--strategies", default="ddp,fsdp", help="--measure: strategies")
    p.add_argument("--steps", type=int, default=10, help="--measure: timed steps per strategy and world size")
    p.add_argument("--warmup", type=int, default=3, help="--measure: untimed steps first")
    p.add_argument("--max-other-cpu", type=float, default=0.1,
                   help="--validate: leave out measured rows while other processes kept more cores busy than this")
    p.add_argument("--rounds", type=int, default=3,
                   help="--measure --validate: rounds of step times and a busy comm fit, pooled")
    p.add_argument("--out", default="bench_results")
    return p.parse_args(argv)


def interconnect(spec: str) -> tuple[Interconnect, dict | None]:
    """A preset, or the links of a comm_fit.json (`measured:PATH`, PATH a file or the folder holding it)."""
    if spec in PRESETS:
        return PRESETS[spec], None
    if not spec.startswith("measured:"):
        raise ConfigError(f"--interconnect {spec!r} is not known; choose from {', '.join(PRESETS)}, or "
                          "measured:PATH/comm_fit.json (written by `disttrain bench comm`)")
    path = Path(spec.removeprefix("measured:"))
    path = path / "comm_fit.json" if path.is_dir() else path
    try:
        fit = json.loads(path.read_text())
        return interconnect_from_fit(fit, spec), fit
    except ConfigError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"--interconnect {spec}: cannot read a comm_fit.json there ({exc}); run "
                          "`disttrain bench comm --out DIR` first") from None


def model_shape(args: argparse.Namespace) -> tuple[ModelShape, str, Config]:
    """(shape, default precision, the config): of --model, a preset (bf16-mixed) with the config's other settings
    (at the sequence length `--set model.seq_len=N` gives, where given: a long context's attention); else the
    config's model, counted."""
    from disttrain.config import load_config

    cfg = load_config(args.config, args.overrides)
    if args.model:
        if args.model not in MODELS:
            raise ConfigError(f"--model {args.model!r} is not a preset; choose from {', '.join(MODELS)}, or leave it "
                              "out to model the model of CONFIG / --set")
        preset = MODELS[args.model]
        if any(o.partition("=")[0].strip() == "model.seq_len" for o in args.overrides) and preset.seq_len:
            preset = replace(preset, seq_len=cfg.model.seq_len)
        return preset, "bf16-mixed", cfg
    return counted_shape(cfg.model), cfg.parallel.precision, cfg


def measure_batch(args: argparse.Namespace, cfg: Config) -> tuple[int, int]:
    """(sequences per rank per step, per forward pass) that `--measure` times: `--local-batch` in micro-batches of
    `--micro-batch`; either alone is one micro-batch (as a forecast reads `--local-batch` alone); neither: one
    micro-batch of the preset's batch or the config's `data.micro_batch_size`."""
    default = LOCAL_BATCH[args.model] if args.model else cfg.data.micro_batch_size
    micro = args.micro_batch or args.local_batch or default
    return args.local_batch or micro, micro


def _precision(args: argparse.Namespace, default: str) -> str:
    name = args.precision or default
    if name not in BYTES:
        raise ConfigError(f"--precision {name!r}: choose from {', '.join(BYTES)}")
    return name


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    _check_numbers(args)
    strategies = list(dict.fromkeys(canonical_strategy(s) for s in args.strategy.split(",") if s.strip()))
    if args.strategy and not strategies:
        raise ConfigError(f"--strategy {args.strategy!r} names no strategy; e.g. --strategy fsdp or ddp,fsdp")
    gpus = integers(args.gpus, "--gpus", "counts >= 1", "8,64,512")
    shape, precision, cfg = model_shape(args)
    precision = _precision(args, precision)
    sitting = args.measure and args.validate
    if args.sweep and (args.measure or args.validate):
        raise ConfigError(f"--sweep {args.sweep}: a forecast's; --validate predicts a measured sweep from its CSV's "
                          "columns (`disttrain bench scaling --sweep`), --measure measures the config as set")
    if sitting and args.interconnect:
        raise ConfigError(f"--interconnect {args.interconnect}: --measure --validate measures this machine's links "
                          "itself; leave --interconnect out (or check a fit with --validate --measured CSV "
                          "--interconnect measured:PATH)")
    args.interconnect = args.interconnect or ("" if sitting else DEFAULT_NET)
    net, fit = (None, None) if sitting else interconnect(args.interconnect)
    if args.measure:
        from disttrain.bench import predict_measure

        args.world_sizes = integers(args.world_sizes, "--world-sizes", "counts >= 1", "1,2,3")
        args.local_batch, args.micro_batch = measure_batch(args, cfg)
        predict_measure.check(args)
        if args.rounds < 1:
            raise ConfigError(f"--rounds {args.rounds}: give 1 or more (3 steadies the busy links)")
        out = make_folder(Path(args.out).resolve(), "--out")
        if not sitting:
            print(f"disttrain: wrote {predict_measure.measure(args, out)}")
            return 0
        dtypes = wire_dtypes(precision, cfg.parallel.grad_compression)
        measured, fit_path = predict_measure.sitting(args, out, dtypes)  # step times and links measured together
        args.measured, args.interconnect = str(measured), f"measured:{fit_path}"
        net, fit = interconnect(args.interconnect)
    net = with_gpus_per_node(net, args.gpus_per_node) if args.gpus_per_node else net
    if args.validate:
        text, rows = validate(args, shape, precision, net, fit, cfg)
    else:
        text, rows = forecast(args, strategies, gpus, shape, precision, net, fit, cfg)
    _write(make_folder(Path(args.out).resolve(), "--out"), text, rows)
    print(text)
    return 0


def _check_numbers(args: argparse.Namespace) -> None:
    """Every numeric flag in its range, before anything is written or launched (0 = "the default" where a flag
    says so)."""
    check_numbers(("--compute-s", args.compute_s, 0.0, "seconds >= 0 (0: from FLOPs)"),
                  ("--tflops", args.tflops, 0.0, "a peak > 0 (0: the H100's in the precision)"),
                  ("--mfu", args.mfu, 1e-9, "a fraction in (0, 1]", 1.0),
                  ("--local-batch", args.local_batch, 0, "sequences >= 0 (0: the preset's or the config's)"),
                  ("--micro-batch", args.micro_batch, 0, "sequences >= 0 (0: the config's, or no accumulation)"),
                  ("--gpus-per-node", args.gpus_per_node, 0, "devices >= 0 (0: the interconnect's)"),
                  ("--nodes", args.nodes, 1, "nodes >= 1"),
                  ("--cpu-cores", args.cpu_cores, -1, "cores >= 0, or -1 for this machine's"),
                  ("--max-other-cpu", args.max_other_cpu, 0.0, "cores >= 0"),
                  ("--steps", args.steps, 1, "steps >= 1"), ("--warmup", args.warmup, 0, "steps >= 0"))


def validate(args, shape, precision, net, fit, cfg) -> tuple[str, list[dict]]:
    """The report and rows of `--validate` (predict_validate.py): (i) against a measured CSV, (ii) published runs."""
    lines, rows = [f"# Validation of the scale model ({report_date()})", ""], []
    if args.measured:
        if fit is None:
            raise ConfigError("--validate --measured needs --interconnect measured:PATH/comm_fit.json from "
                              "`disttrain bench comm` on the machine the CSV was measured on")
        measured_lines, rows = measured_checks(args, shape, precision, net, cfg, cpu_cores(args, fit))
        lines += measured_lines
    published_lines, published_rows = published_checks()
    return "\n".join(lines + published_lines + ["", report_footer()]) + "\n", rows + published_rows


def _write(out: Path, text: str, rows: list[dict]) -> None:
    (out / "predict.md").write_text(text)
    with open(out / "predict.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
