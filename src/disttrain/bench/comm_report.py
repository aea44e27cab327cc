"""`disttrain bench comm`'s figures from its ranks' raw times (comm_raw.json): the table (latency, algorithm and bus
bandwidth per size), the fit of t = alpha + beta x bytes per collective and element type that the scale model reads
(comm_fit.json), comm.csv, comm.md and comm.png."""

from __future__ import annotations

import csv
import json
import platform
import statistics
import sys
from pathlib import Path

from disttrain.bench.interconnect import bus_factor, fit_alpha_beta


def summarise(raw: dict) -> tuple[list[dict], dict]:
    """(CSV rows, the fit) of the raw per-iteration times. The fit goes through each size's median, or its mean where
    `raw["fit_statistic"]` says so (`disttrain bench predict`'s pooled sitting: a step pays the sum of its calls, so
    their expectation, and a bimodal time's median jumps between the modes where the mean moves with their mix).
    On a CPU host the CPU seconds of the process group's threads per call (`cpu_s`) are fitted the same way
    (`cpu_alpha_s`, `cpu_beta_s_per_byte`): what a call issued while its rank computes takes from the cores.
    Per element type (`--dtype`): the first one's fits are the fit's `collectives` (its `dtype`), the others' are
    under `dtypes`."""
    n, table = raw["world_size"], []
    statistic = raw.get("fit_statistic", "median")
    for r in raw["rows"]:
        median = statistics.median(r["times_s"])
        algbw = r["bytes"] / median / 1e9
        table.append({"collective": r["collective"], "dtype": r.get("dtype", "float32"), "bytes": r["bytes"],
                      "world_size": n, "backend": raw["backend"],
                      "iterations": r["iterations"], "time_median_s": median,
                      "time_mean_s": statistics.mean(r["times_s"]), "time_min_s": min(r["times_s"]),
                      "algbw_GBps": algbw, "busbw_GBps": algbw * bus_factor(r["collective"], n),
                      **({"cpu_median_s": statistics.median(r["cpu_s"]), "cpu_mean_s": statistics.mean(r["cpu_s"])}
                         if r.get("cpu_s") else {})})
    fits: dict[str, dict] = {}
    for dtype, c in dict.fromkeys((r["dtype"], r["collective"]) for r in table):
        rows = [r for r in table if (r["dtype"], r["collective"]) == (dtype, c)]
        points = [(r["bytes"], r[f"time_{statistic}_s"]) for r in rows]
        alpha, beta = fit_alpha_beta([b for b, _ in points], [t for _, t in points])
        worst = max(abs(alpha + beta * b - t) / t for b, t in points)
        fits.setdefault(dtype, {})[c] = {
            "alpha_s": alpha, "beta_s_per_byte": beta, "bandwidth_Bps": 1 / beta if beta else None,
            "bus_bandwidth_Bps": bus_factor(c, n) / beta if beta else None, "max_rel_error": worst,
            "sizes_bytes": [points[0][0], points[-1][0]]}
        if all(r.get(f"cpu_{statistic}_s", 0) > 0 for r in rows):  # (a CPU host's: the backend's threads' time)
            cpu_alpha, cpu_beta = fit_alpha_beta([r["bytes"] for r in rows], [r[f"cpu_{statistic}_s"] for r in rows])
            fits[dtype][c].update(cpu_alpha_s=cpu_alpha, cpu_beta_s_per_byte=cpu_beta)
    first = next(iter(fits))
    fit = {"backend": raw["backend"], "world_size": n, "device": raw["device"], "host": raw["host"],
           "date": raw["date"], "torch": raw["torch"], "model": "t = alpha + beta * bytes (nccl-tests' size)",
           "statistic": statistic,
           "busy": raw.get("busy", False), **({"compute_ms": raw["compute_ms"]} if "compute_ms" in raw else {}),
           "dtype": first, "collectives": fits[first],
           **({"dtypes": {d: f for d, f in fits.items() if d != first}} if len(fits) > 1 else {})}
    return table, fit


def _named_dtypes(fit: dict) -> bool:
    """Whether labels name the element type: unless the fit is of float32 alone."""
    return bool(fit.get("dtypes")) or fit.get("dtype", "float32") != "float32"


def _fits(fit: dict) -> list[tuple[str, str, dict]]:
    """(label, dtype, fit) of every fitted collective, each dtype's in turn (`_named_dtypes`)."""
    dtypes = {fit.get("dtype", "float32"): fit["collectives"], **fit.get("dtypes", {})}
    return [(f"{c} ({d})" if _named_dtypes(fit) else c, d, f) for d, fits in dtypes.items() for c, f in fits.items()]


def _size(b: float) -> str:
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if b >= scale:
            return f"{b / scale:g}{unit}"
    return f"{b:g}"


def _busy_text(raw: dict) -> str:
    if raw.get("busy") == "step":
        return (f"; each rank computing {raw['compute_ms']:g} ms before each call, into new tensors as FSDP2's "
                "(--busy step)")
    return "; a thread per rank computing meanwhile (--busy 1)" if raw.get("busy") else ""


def report(raw: dict, out: Path) -> None:
    """comm.csv, comm_fit.json, comm.png (when matplotlib is importable) and comm.md."""
    from disttrain._version import __version__

    table, fit = summarise(raw)
    with open(out / "comm.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for row in table for k in row)))
        writer.writeheader()
        writer.writerows(table)
    (out / "comm_fit.json").write_text(json.dumps(fit, indent=2))
    plotted = plot(table, fit, out / "comm.png")
    lines = [f"# Collectives: latency and bandwidth ({raw['date']})", "",
             f"{raw['world_size']} ranks, {raw['backend']} on {raw['device']}"
             f"{' (' + ', '.join(raw['devices']) + ')' if raw['devices'] else ''}, 1 torch thread per rank; "
             f"{', '.join(raw.get('dtypes', ['float32']))} buffers{_busy_text(raw)}; "
             f"the slowest rank's time per call after {raw['warmup']} warm-up calls: latency and bandwidths "
             f"from the median, the fit through each size's {raw.get('fit_statistic', 'median')}. "
             f"Other processes kept {raw['other_cpu']:.2f} cores busy meanwhile (0 = a quiet machine).",
             "",
             "| collective | size | bytes | iters | latency (us) | algbw (GB/s) | busbw (GB/s) |",
             "|---|---|---|---|---|---|---|"]
    several = _named_dtypes(fit)
    lines += [f"| {r['collective']}{' (' + r['dtype'] + ')' if several else ''} | {_size(r['bytes'])} | "
              f"{r['bytes']} | {r['iterations']} | "
              f"{r['time_median_s'] * 1e6:.1f} | {r['algbw_GBps']:.3f} | {r['busbw_GBps']:.3f} |" for r in table]
    lines += ["", "Fit t = alpha + beta x bytes (least squares on the relative error):", "",
              "| collective | alpha (us) | beta (ns/byte) | 1/beta (GB/s) | bus bandwidth (GB/s) | worst error |",
              "|---|---|---|---|---|---|"]
    for c, _, f in _fits(fit):
        bw = f"{f['bandwidth_Bps'] / 1e9:.3f} | {f['bus_bandwidth_Bps'] / 1e9:.3f}" if f["beta_s_per_byte"] else "- | -"
        lines.append(f"| {c} | {f['alpha_s'] * 1e6:.1f} | {f['beta_s_per_byte'] * 1e9:.4f} | {bw} | "
                     f"{f['max_rel_error'] * 100:.0f}% |")
    cpu = {c: f for c, _, f in _fits(fit) if "cpu_alpha_s" in f}
    if cpu:
        lines += ["", "CPU time of the process group's threads (gloo's) per call, fitted the same way: what a call "
                  "issued while its rank computes takes from the cores (the scale model charges it for DDP's buckets "
                  "on a host whose cores all run ranks):", "", "| collective | cpu alpha (us) | cpu beta (ns/byte) |",
                  "|---|---|---|"]
        lines += [f"| {c} | {f['cpu_alpha_s'] * 1e6:.1f} | {f['cpu_beta_s_per_byte'] * 1e9:.4f} |"
                  for c, f in cpu.items()]
    lines += ["", "comm.png: latency and bus bandwidth vs size." if plotted else
              "comm.png not written: pip install 'disttrain[plot]'", "",
              f"Machine: {raw['host']} ({raw['machine']}); torch {raw['torch']}, disttrain {__version__}, Python "
              f"{platform.python_version()}. busbw: all_reduce x 2(n-1)/n, all_gather / reduce_scatter / all_to_all "
              "x (n-1)/n, broadcast x 1 (nccl-tests)."]
    (out / "comm.md").write_text("\n".join(lines) + "\n")


def plot(table: list[dict], fit: dict, path: Path) -> bool:
    """Latency and busbw vs size per collective, log-log; False (and one line) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("disttrain: comm.png not written: pip install 'disttrain[plot]'", file=sys.stderr)
        return False
    fig, (lat, bw) = plt.subplots(1, 2, figsize=(11, 4.2))
    fitted = _fits(fit)
    colours = {c: f"C{i}" for i, c in enumerate(dict.fromkeys(label.split(" ")[0] for label, _, _ in fitted))}
    styles = {d: style for d, style in zip(dict.fromkeys(d for _, d, _ in fitted), ("o-", "s--", "^-."), strict=False)}
    for label, dtype, f in fitted:  # a colour per collective, a line style per element type
        c = label.split(" ")[0]
        rows = [r for r in table if (r["collective"], r["dtype"]) == (c, dtype)]
        x = [r["bytes"] for r in rows]
        lat.loglog(x, [r[f"time_{fit.get('statistic', 'median')}_s"] * 1e6 for r in rows], styles[dtype],
                   color=colours[c], label=label, markersize=3)
        lat.loglog(x, [(f["alpha_s"] + f["beta_s_per_byte"] * b) * 1e6 for b in x], ":", color=colours[c])
        bw.loglog(x, [r["busbw_GBps"] for r in rows], styles[dtype], color=colours[c], label=label, markersize=3)
    lat.set(xlabel="message size (bytes)", ylabel="latency (us)", title="latency (dotted: alpha + beta x bytes)")
    bw.set(xlabel="message size (bytes)", ylabel="bus bandwidth (GB/s)", title="bus bandwidth")
    lat.legend(fontsize=8)
    fig.suptitle(f"{fit['backend']}, {fit['world_size']} ranks, {fit['host']}, {fit['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
