"""The scaling benchmark's report: rows of every launch assembled (efficiency needs the world-size-1 row), written
as scaling.csv, scaling.md and, when matplotlib is importable, efficiency.png and throughput.png."""

from __future__ import annotations

import csv
import math
import os
import platform
import statistics
import time
from pathlib import Path

COLUMNS = ("strategy", "loop", "mode", "world_size", "sweep_key", "sweep_value", "global_batch", "micro_batch",
           "log_every", "params", "trained_params", "step_time_s", "tokens_per_s", "tokens_per_s_per_rank",
           "efficiency", "target", "result", "efficiency_vs_hand_written", "comm_fraction", "comm_bytes",
           "mem_peak_gib", "mfu", "eval_loss", "oversubscribed", "launches")
TARGETS = {"weak": 0.90, "strong": 0.80}
VS_HAND_WRITTEN_TARGET = 0.98
PLOT_HINT = "PNGs not written: matplotlib is not installed; pip install 'disttrain[plot]'"


def merge(rows: list[dict]) -> list[dict]:
    """One row per strategy, loop, sweep value and world size: the median over repeated launches (the peak memory:
    the max), in the order first seen."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in ("strategy", "loop", "sweep_value", "world_size")), []).append(r)
    out = []
    for group in groups.values():
        row = dict(group[0])
        for k, v in row.items():
            if isinstance(v, float):
                found = [g[k] for g in group if not math.isnan(g[k])]
                row[k] = (max(found) if k == "mem_peak_gib" else statistics.median(found)) if found else math.nan
        out.append({**row, "launches": len(group)})
    return sorted(out, key=lambda r: r["world_size"])  # stable: the launch's own order within a world size


def assemble(rows: list[dict], mode: str, cuda: bool, cores: int) -> list[dict]:
    """Throughputs, efficiency against the same strategy, loop and sweep value at world size 1, PASS/FAIL, and
    disttrain's ddp efficiency over the hand-written loop's at the same world size and sweep value."""
    out = []
    for r in merge(rows):
        tokens = r["global_batch"] * r["seq_len"] / r["step_time_s"]
        out.append({**{c: math.nan for c in COLUMNS}, **{k: v for k, v in r.items() if k != "seq_len"},
                    "tokens_per_s": tokens, "tokens_per_s_per_rank": tokens / r["world_size"],
                    "target": TARGETS[mode], "oversubscribed": not cuda and r["world_size"] > cores})

    def key(r, **change):
        return tuple({**r, **change}[k] for k in ("strategy", "loop", "sweep_value", "world_size"))

    by_key = {key(r): r for r in out}
    for r in out:
        one = by_key.get(key(r, world_size=1))
        r["efficiency"] = r["tokens_per_s"] / (r["world_size"] * one["tokens_per_s"]) if one else math.nan
        r["result"] = "PASS" if r["efficiency"] >= r["target"] else "FAIL"
    for r in out:
        plain = by_key.get(key(r, loop="hand-written"))
        if r["loop"] == "disttrain" and plain is not None:
            r["efficiency_vs_hand_written"] = r["efficiency"] / plain["efficiency"]
    return out


def write(rows: list[dict], plan, args, out: Path, command: str, load: list[float]) -> str:
    """Write scaling.csv, scaling.md and the PNGs into `out`; return the markdown."""
    rows = assemble(rows, args.mode, plan.cuda, plan.cores)
    with open(out / "scaling.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows({c: r[c] for c in COLUMNS} for r in rows)
    plots = _plots(rows, args.mode, out)
    text = _markdown(rows, plan, args, command, load, plots)
    (out / "scaling.md").write_text(text)
    return text


def _fmt(value, spec: str = ".3f") -> str:
    return "n/a" if isinstance(value, float) and math.isnan(value) else format(value, spec)


def _markdown(rows: list[dict], plan, args, command: str, load: list[float], plots: list[str]) -> str:
    import torch

    from disttrain._version import __version__
    from disttrain.config import dumps_toml

    date = time.strftime("%Y-%m-%d %H:%M:%S")
    lines = [f"# The cost of scale: {args.mode} scaling ({date})", "", f"`{command}`", "",
             "| strategy | loop | sweep | ranks | global batch | micro | step ms | tokens/s | tokens/s/rank | "
             "efficiency | target | result | comm fraction | comm MiB/step | peak GiB | eval loss |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sweep = f"{r['sweep_key'].split('.')[-1]}={r['sweep_value']}" if r["sweep_value"] else ""
        star = " (oversubscribed)" if r["oversubscribed"] else ""
        lines.append(f"| {r['strategy']} | {r['loop']} | {sweep} | {r['world_size']} | {r['global_batch']} | "
                     f"{r['micro_batch']} | {r['step_time_s'] * 1e3:.1f} | {r['tokens_per_s']:.0f} | "
                     f"{r['tokens_per_s_per_rank']:.0f} | **{_fmt(r['efficiency'])}** | {r['target']:.2f} | "
                     f"{r['result']}{star} | {_fmt(r['comm_fraction'])} | {_fmt(r['comm_bytes'] / 2**20, '.2f')} | "
                     f"{_fmt(r['mem_peak_gib'], '.2f')} | {_fmt(r['eval_loss'], '.4f')} |")
    lines += ["", *_versus_hand_written(rows), ""]
    if any(r["oversubscribed"] for r in rows):
        lines.append(f"Rows marked oversubscribed run more ranks than the {plan.cores} core(s) this process may use: "
                     "the ranks share cores, so those rows are expected to FAIL; they measure the machine, not the "
                     "strategy.")
    m = plan.base.model
    lines += [
        "", f"Efficiency = tokens/s at w ranks / (w x tokens/s at 1 rank, same strategy, loop and sweep value); "
        f"{'weak: the batch per rank is fixed' if args.mode == 'weak' else 'strong: the global batch is fixed'}. "
        f"A step's time is the slowest rank's; each row is the median of {args.rounds * args.steps} timed steps "
        f"({args.rounds} rounds x {args.steps}; ddp interleaved with the hand-written loop)"
        f"{f', then the median over {args.repeats} launches per world size' if args.repeats > 1 else ''}. "
        "comm fraction = "
        "comm_exposed_s / step time and comm MiB = comm_bytes per rank per step, as the step reports them (n/a "
        "while it does not); peak GiB = the most loaded rank's peak "
        f"{'CUDA memory allocated' if plan.cuda else 'resident set (the whole process: torch included)'} over "
        f"the fixed run; eval loss = validation loss after a fixed run of {args.eval_steps} steps from the seed "
        f"({plan.base.train.eval_samples or 'all'} validation sequences), the same for every row.",
        "", f"Machine: {machine(plan.cuda, plan.cores)}; load average {load[0]:.2f} before, {load[1]:.2f} after. "
        f"Job: GPT {m.n_layer} layers x d_model {m.d_model}, seq_len {m.seq_len}, {plan.base.parallel.precision}; "
        f"{plan.base.dist.threads_per_rank or 'auto'} torch thread(s) per rank. torch {torch.__version__}, "
        f"disttrain {__version__}, Python {platform.python_version()}.", "",
        *(f"![{p}]({p})" for p in plots), *([] if plots else [PLOT_HINT]), "",
        "<details><summary>config (world size 1; the batch follows the mode)</summary>", "", "```toml",
        dumps_toml(plan.base).strip(), "```", "</details>", ""]
    return "\n".join(lines)


def machine(cuda: bool, cores: int) -> str:
    """Cores and CPU model, or the GPUs, in words."""
    import torch

    if cuda:
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        return f"{len(names)} x {names[0]}; {os.cpu_count()} CPU cores"
    model = "unknown CPU"
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cores} CPU core(s) available to this process ({os.cpu_count()} in the machine), {model}"


def _versus_hand_written(rows: list[dict]) -> list[str]:
    pairs = [r for r in rows if not math.isnan(r["efficiency_vs_hand_written"]) and r["world_size"] > 1]
    if not pairs:
        return []
    plain = {(r["strategy"], r["sweep_value"], r["world_size"]): r for r in rows if r["loop"] == "hand-written"}
    speed = {(r["sweep_value"], r["world_size"]): r["tokens_per_s"] / plain[key]["tokens_per_s"]
             for r in rows if r["loop"] == "disttrain" and (key := (r["strategy"], r["sweep_value"], r["world_size"]))
             in plain}
    out = ["disttrain's ddp against the hand-written DDP loop (same processes, interleaved rounds); the last two "
           "columns are disttrain's tokens/s over the hand-written loop's, at 1 rank and at this world size (the "
           "efficiency ratio is the second over the first):", "",
           "| sweep | ranks | disttrain efficiency | hand-written efficiency | ratio | target | result | "
           "speed at 1 | speed here |", "|---|---|---|---|---|---|---|---|---|"]
    for r in pairs:
        ratio, w, value = r["efficiency_vs_hand_written"], r["world_size"], r["sweep_value"]
        out.append(f"| {value} | {w} | {r['efficiency']:.3f} | {plain[r['strategy'], value, w]['efficiency']:.3f} | "
                   f"**{ratio:.3f}** | >= {VS_HAND_WRITTEN_TARGET} | "
                   f"{'PASS' if ratio >= VS_HAND_WRITTEN_TARGET else 'FAIL'} | "
                   f"{_fmt(speed.get((value, 1), math.nan))} | {speed[value, w]:.3f} |")
    return out


def _plots(rows: list[dict], mode: str, out: Path) -> list[str]:
    """efficiency.png and throughput.png against world size, one line per strategy / loop / sweep value."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    lines: dict[str, list[dict]] = {}
    for r in rows:
        label = r["strategy"] + (" hand-written" if r["loop"] == "hand-written" else "")
        label += f" {r['sweep_key'].split('.')[-1]}={r['sweep_value']}" if r["sweep_value"] else ""
        lines.setdefault(label, []).append(r)
    names = []
    for name, column, ylabel in (("efficiency.png", "efficiency", "scaling efficiency"),
                                 ("throughput.png", "tokens_per_s", "tokens/s (global)")):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for label, points in lines.items():
            style = "--" if "hand-written" in label else "-"
            ax.plot([p["world_size"] for p in points], [p[column] for p in points], style, marker="o", label=label)
        if column == "efficiency":
            ax.axhline(rows[0]["target"], color="grey", linestyle=":", label=f"target {rows[0]['target']:.2f}")
            ax.set_ylim(0, max(1.1, *(r["efficiency"] for r in rows if not math.isnan(r["efficiency"]))))
        ax.set_xlabel("world size (ranks)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{mode} scaling")
        ax.set_xticks(sorted({r["world_size"] for r in rows}))
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        names.append(name)
    return names
