"""`disttrain bench predict --validate`: the scale model against what was measured (a CSV of `bench scaling` or of
`--measure`, and a comm_fit.json of the same machine: every N-rank step of a series predicted from its 1-rank step)
and against the published scaling it must reproduce (published_scaling.py)."""

from __future__ import annotations

import csv
import math
import statistics
from pathlib import Path

from disttrain.bench.interconnect import Interconnect, with_gpus_per_node
from disttrain.bench.model_shapes import ModelShape
from disttrain.bench.predict_job import (
    context_calls_of,
    pipeline_orders,
    pipeline_stages,
    scaled_calls,
    series_settings,
    split_group,
    stage_calls_of,
    tensor_calls_of,
)
from disttrain.bench.published_scaling import PUBLISHED
from disttrain.bench.scale_model import STRATEGIES, Workload, step_time
from disttrain.config import Config
from disttrain.errors import ConfigError

SERIES_KEYS = ("strategy", "mode", "loop", "sweep_key", "sweep_value")
"""Columns that tell one measured series from another (`bench scaling` adds the loop and a swept setting)."""


Measured = dict[str, tuple[str, dict[int, dict], str]]
"""label -> (strategy, world size -> figures, the series' swept setting as `section.key=value` or '')."""


SPLIT_COLUMNS = ("tensor", "pipeline", "context")
"""A measured CSV's columns of the model's split degrees (`bench predict --measure` writes them)."""


def read_measured(path: Path, shape: ModelShape, max_other_cpu: float, split: tuple[int, ...] = (1, 1, 1)
                  ) -> tuple[Measured, int]:
    """(label -> (strategy, world size -> {step_time_s, local: samples per data replica per step (a rank's, or a
    group's where the CSV's `SPLIT_COLUMNS` split the model, which must be `split`: the config's degrees;
    0 if unknown),
    micro_steps, log_every: 1 where the row's median step gathered the ranks' figures}, swept setting) for every
    series of a modelled strategy, rows left out). A row whose `other_cpu` (where the CSV has one) is above
    `max_other_cpu` measured its neighbours too and is left out. A CSV whose `params` or `trained_params` (where it
    has them) are not the model's was measured on another job: one line (but for a series swept over the model,
    which `series_settings` leaves out)."""
    try:
        with open(path, newline="") as f:
            table = list(csv.DictReader(f))
    except OSError as exc:
        raise ConfigError(f"--measured {path}: {exc.strerror}; write it with `disttrain bench predict --measure`"
                          ) from None
    missing = {"strategy", "world_size", "step_time_s"} - set(table[0] if table else {})
    if missing:
        raise ConfigError(f"--measured {path}: no column {', '.join(sorted(missing))} (needs strategy, world_size, "
                          "step_time_s)")
    for line, row in enumerate(table, start=2):
        _check_row(path, line, row)
    _check_job(path, table, shape, split)
    noisy = [r for r in table if float(r.get("other_cpu") or 0.0) > max_other_cpu]
    if table and len(noisy) == len(table):
        raise ConfigError(f"--measured {path}: every row was measured while other processes kept more than "
                          f"{max_other_cpu:g} cores busy (other_cpu); measure on a quiet machine, or raise "
                          "--max-other-cpu")
    series: dict[str, tuple[str, dict[int, list[dict]]]] = {}
    for row in table:
        if row["strategy"] in STRATEGIES and row not in noisy:
            label = " ".join(row[k] for k in SERIES_KEYS if row.get(k))
            series.setdefault(label, (row["strategy"], {}))[1].setdefault(int(row["world_size"]), []).append(row)
    if not series:
        raise ConfigError(f"--measured {path}: no row of a modelled strategy ({', '.join(STRATEGIES)}); write it with "
                          "`disttrain bench predict --measure` or `disttrain bench scaling`")
    result = {}
    for label, (strategy, worlds) in series.items():
        by_world = {}
        for world, rows in worlds.items():
            # a group reads one batch (a CSV without the columns, of `bench scaling`, measured the job as configured)
            group = math.prod(int(rows[0].get(key) or own) for key, own in zip(SPLIT_COLUMNS, split, strict=True))
            replicas = max(1, world // group)
            local = float(rows[0]["global_batch"]) / replicas if rows[0].get("global_batch") else 0.0
            micro = float(rows[0]["micro_batch"]) if rows[0].get("micro_batch") else local
            by_world[world] = {"step_time_s": statistics.median(float(r["step_time_s"]) for r in rows),
                               "local": local, "micro_steps": max(1, round(local / micro)) if micro else 1,
                               "log_every": _log_every(rows[0])}
        first = worlds[min(worlds)][0]
        swept = f"{first['sweep_key']}={first['sweep_value']}" if first.get("sweep_key") else ""
        result[label] = (strategy, by_world, swept)
    return result, len(noisy)


def _check_job(path: Path, table: list[dict], shape: ModelShape, split: tuple[int, ...]) -> None:
    """The CSV was measured on the job given: its model's parameters (but for a series swept over the model) and its
    split degrees, where it has the columns; one line otherwise."""
    for column, own, what in (("params", shape.params, "parameters"), ("trained_params", shape.trained_params,
                                                                         "trained parameters (model.freeze)")):
        wrong = {r[column] for r in table if r.get(column) and abs(float(r[column]) - own) > 0.5
                 and not (r.get("sweep_key") or "").startswith("model.")}  # (swept over the model: not predicted)
        if wrong:
            raise ConfigError(f"--measured {path} was measured on a model of {', '.join(sorted(wrong))} {what}, the "
                              f"model given here has {own:.0f}: pass the same CONFIG / --set as the measurement")
    for key, own in zip(SPLIT_COLUMNS, split, strict=True):
        other = {int(r[key]) for r in table if r.get(key)} - {own}
        if other:
            raise ConfigError(f"--measured {path} was measured with parallel.{key} = {min(other)}, the job given here "
                              f"has {own}: pass the same CONFIG / --set as the measurement (--set parallel.{key}="
                              f"{min(other)})")


def _log_every(row: dict) -> int:
    """The logged lines a measured row's step pays for, as the scale model's `Workload.log_every`: 1 where every step
    gathered the ranks' figures, else 0. A row's step time is a median over steps, which leaves out a step in
    `train.log_every` (its CSV column) that gathers. (A CSV without the column: disttrain logged every step then, a
    hand-written loop never.)"""
    if row.get("log_every") not in (None, ""):
        return 1 if float(row["log_every"]) == 1 else 0
    return 0 if row.get("loop") == "hand-written" else 1


def _check_row(path: Path, line: int, row: dict) -> None:
    """A measured row's figures are numbers: world size >= 1, step time > 0, the optional columns numeric."""
    try:
        world, step = int(row["world_size"]), float(row["step_time_s"])
        numbers = [float(row[k]) for k in ("global_batch", "micro_batch", "log_every", "params", "trained_params",
                                           "other_cpu") if row.get(k)]
        degrees = [int(row[k]) for k in SPLIT_COLUMNS if row.get(k)]
    except (TypeError, ValueError):
        world, step, numbers, degrees = 0, 0.0, [], []
    if world < 1 or not 0 < step < math.inf or not all(math.isfinite(x) and x >= 0 for x in numbers) or \
            not all(d >= 1 for d in degrees):
        raise ConfigError(f"--measured {path}, line {line}: expected a world_size >= 1, a step_time_s > 0 (seconds), "
                          "numbers >= 0 in global_batch, micro_batch, log_every, params, trained_params and "
                          "other_cpu, and whole numbers >= 1 in tensor, pipeline and context; got "
                          + ", ".join(f"{k} {v!r}" for k, v in row.items() if k != "strategy"))


def measured_checks(args, shape: ModelShape, precision: str, net: Interconnect, cfg: Config, cores: int
                    ) -> tuple[list[str], list[dict]]:
    """(i): the report's lines and rows of every measured series of `args.measured` (those with a 1-rank row and a
    modelled sweep), each N-rank step predicted from the series' 1-rank step on `net`'s measured links."""
    rows = []
    measured, dropped = read_measured(Path(args.measured), shape, args.max_other_cpu,
                                      (cfg.parallel.tensor, cfg.parallel.pipeline, cfg.parallel.context))
    worlds = [w for _, by_world, _ in measured.values() for w in by_world]
    net = with_gpus_per_node(net, args.gpus_per_node or max(worlds))  # every rank on this one machine
    lines = [f"## (i) Measured on this machine: {args.measured}", "",
             f"Model {shape.name} ({shape.params / 1e6:.2f} M parameters, {precision}); links from "
             f"{args.interconnect} ({net.note}); {cores} cores (0 = accelerator); every N-rank step predicted "
             "from the 1-rank step. Target: |error| <= 10%.", "",
             "| series | ranks | measured (s) | predicted (s) | error | collectives (s) |",
             "|---|---|---|---|---|---|"]
    group = split_group(cfg)
    skipped = [label for label, (_, by_world, _) in measured.items() if 1 not in by_world]
    refused = []
    for label, (strategy, by_world, swept) in measured.items():
        if label in skipped:
            continue
        try:
            job = series_settings(args.config, args.overrides, cfg, swept)
        except ConfigError as exc:  # (a series swept to powersgd, or over the model: the others are checked)
            refused.append(f"{label} ({exc})")
            continue
        base = by_world[1]
        for world, m in sorted(by_world.items()):
            scale = m["local"] / base["local"] if base["local"] else 1.0
            sequences = m["local"] / m["micro_steps"]
            beside = world > group  # (a data axis: a mixed precision's stream in the compute dtype)
            calls = scaled_calls(tensor_calls_of(cfg, shape, precision, 1.0, beside), sequences)
            split, stage = pipeline_stages(cfg, shape, precision, beside), stage_calls_of(cfg, shape, precision,
                                                                                           sequences, beside)
            work = Workload(shape, base["step_time_s"] * scale / job["pipeline"], 1.0, precision, m["micro_steps"],
                            cpu_cores=cores, **{**job, "log_every": m["log_every"]}, tensor_calls=calls,
                            context_calls=context_calls_of(cfg, shape, precision, sequences),
                            stage_calls=stage.stages, step_calls=stage.steps,
                            orders=pipeline_orders(cfg, m["micro_steps"]),
                            stages=split.stages, send_bytes=split.send_bytes * sequences,
                            tied_bytes=split.tied_bytes)  # (log_every: the gathers a median pays)
            s = step_time(strategy, world, work, net)
            error = s.step_s / m["step_time_s"] - 1
            rows.append({"check": "measured", "case": label, "gpus": world, "reference": m["step_time_s"],
                         "predicted": s.step_s, "error": error})
            lines.append(f"| {label} | {world} | {m['step_time_s']:.4f} | {s.step_s:.4f} | {error:+.1%} | "
                         f"{s.comm_s:.4f} |")
    if skipped:
        lines += ["", f"Not predicted (no 1-rank row to start from): {', '.join(skipped)}."]
    if refused:
        lines += ["", f"Not predicted: {'; '.join(refused)}."]
    if not rows:
        raise ConfigError(f"--measured {args.measured}: no series could be predicted ("
                          + "; ".join(refused + [f"{label}: no 1-rank row" for label in skipped]) + ")")
    if dropped:
        lines += ["", f"Left out: {dropped} rows measured while other processes kept more than "
                  f"{args.max_other_cpu:g} cores busy (their `other_cpu`)."]
    lines.append("")
    return lines, rows


def published_checks() -> tuple[list[str], list[dict]]:
    """(ii): the report's lines and rows of the published runs the model must reproduce."""
    rows, lines = [], ["## (ii) Published scaling", "",
                       "| case | GPUs | published efficiency | predicted | difference | tolerance | within |",
                       "|---|---|---|---|---|---|---|"]
    for case in PUBLISHED:
        predicted = case.predicted()[-1].efficiency
        diff = predicted - case.efficiency
        ok = abs(diff) <= case.tolerance
        rows.append({"check": "published", "case": case.name, "gpus": case.gpus[1], "reference": case.efficiency,
                     "predicted": predicted, "error": diff})
        lo, hi = case.efficiency - case.tolerance, case.efficiency + case.tolerance
        published, diff_text, band = ((f"{case.shape} (read as {lo:.2f}-{hi:.2f})", "-", f"{lo:.2f}-{hi:.2f}")
                                      if case.shape else (f"{case.efficiency:.3f}", f"{diff:+.3f}",
                                                          f"+-{case.tolerance:g}"))
        lines.append(f"| {case.name} | {case.gpus[0]} -> {case.gpus[1]} | {published} | {predicted:.3f} | "
                     f"{diff_text} | {band} | {'yes' if ok else 'NO'} |")
    lines += [""] + [f"- {c.name}: {c.source}. Assumed: {c.assumptions}." for c in PUBLISHED]
    return lines, rows
