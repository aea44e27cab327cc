"""`disttrain plot RUN_DIR [RUN_DIR ...] [--out DIR]`: the figures of runs' `metrics.jsonl` against step.

Six panels, several runs overlaid (one colour per run, labelled by its folder's name): loss (train; eval as points),
learning rate, tokens/s, MFU, peak memory (this rank's and the largest over ranks) and the fraction of the step spent
in communication (exposed: the part the step waited for; in flight, dashed). Written as PNG: `plot.png` (all six)
and one file per panel, into `--out` (default: the first RUN_DIR's `plots/`).

matplotlib is the optional extra `disttrain[plot]`. The figures are drawn on matplotlib's `Figure` with the Agg
canvas, never through pyplot: no display, no global figure state.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from disttrain.errors import ConfigError, make_folder

MFU_UNKNOWN = "MFU needs a known accelerator or log.peak_tflops"
NO_COMM = "no collectives timed (one process without a process group)"


@dataclass
class Run:
    label: str
    rows: list[dict[str, Any]]

    def series(self, key: str, scale: Callable[[dict, float], float | None] | None = None
               ) -> tuple[list[int], list[float]]:
        """(steps, values) of the lines that carry a number under `key` (null and absent keys are left out; JSON's
        spelled-out "nan"/"inf" become floats). `scale(row, value)` turns a value into what is drawn."""
        steps, values = [], []
        for row in self.rows:
            value = _number(row.get(key))
            if value is not None and scale is not None:
                value = scale(row, value)
            if value is not None:
                steps.append(row["step"])
                values.append(value)
        return steps, values


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value.lower() in ("nan", "inf", "-inf", "infinity", "-infinity"):
        return float(value)  # metrics.py writes non-finite floats as strings
    return None


def read_run(run_dir: Path) -> list[dict[str, Any]]:
    """The lines of RUN_DIR/metrics.jsonl; a one-line ConfigError for a missing folder or file, or a line that is not
    a JSON object with a step (naming the file and the line)."""
    if not run_dir.is_dir():
        raise ConfigError(f"run dir '{run_dir}' does not exist; pass the folder a `disttrain train` run wrote")
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"'{run_dir}' has no metrics.jsonl; pass the folder a `disttrain train` run wrote "
                          "(run.out_dir/run.name)")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError(f"{path}: cannot read it ({reason}); pass the folder a `disttrain train` run wrote") from None
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}, line {number}: not JSON ({exc.msg}); the file is damaged") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise ConfigError(f"{path}, line {number}: not a metrics line (a JSON object with an integer 'step')")
        rows.append(row)
    if not rows:
        raise ConfigError(f"{path} has no lines yet: nothing to plot")
    return rows


def labels(run_dirs: list[Path]) -> list[str]:
    """Each run's folder name; folders of the same name are told apart by their parent's name."""
    names = [d.resolve().name for d in run_dirs]
    return [f"{d.resolve().parent.name}/{n}" if names.count(n) > 1 else n
            for d, n in zip(run_dirs, names, strict=True)]


def _ratio(key: str) -> Callable[[dict, float], float | None]:
    """A value over the line's step time, in percent (None where the step time is missing)."""
    def scale(row: dict, value: float) -> float | None:
        step_time = _number(row.get("step_time_s"))
        return 100.0 * value / step_time if step_time else None
    return scale


def _line(ax, series: tuple[list[int], list[float]], *style, **kwargs) -> bool:
    """Draw a series that has points (an empty one would still take a legend entry); whether it had any."""
    if series[0]:
        ax.plot(*series, *style, **kwargs)
    return bool(series[0])


def _loss(ax, runs: list[Run], colors: list) -> None:
    for run, color in zip(runs, colors, strict=True):
        _line(ax, run.series("loss"), color=color, label=run.label)
        _line(ax, run.series("eval_loss"), "o", color=color, markersize=4, label=f"{run.label} eval")
    ax.set_title("loss")


def _simple(key: str, title: str, scale=None, empty: str = "") -> Callable:
    """A panel of one series per run; `empty`: the note shown when no run has a value."""
    def draw(ax, runs: list[Run], colors: list) -> None:
        drawn = [_line(ax, run.series(key, scale), color=color, label=run.label)
                 for run, color in zip(runs, colors, strict=True)]
        ax.set_title(title)
        if empty and not any(drawn):
            _note(ax, empty)
    return draw


def _memory(ax, runs: list[Run], colors: list) -> None:
    for run, color in zip(runs, colors, strict=True):
        _line(ax, run.series("mem_peak_gib"), color=color, label=f"{run.label} rank 0")
        _line(ax, run.series("mem_peak_gib_max"), color=color, linestyle=":", label=f"{run.label} max over ranks")
    ax.set_title("peak memory (GiB)")
    ax.set_ylim(bottom=0)


def _comm(ax, runs: list[Run], colors: list) -> None:
    drawn = []
    for run, color in zip(runs, colors, strict=True):
        drawn.append(_line(ax, run.series("comm_exposed_s", _ratio("comm_exposed_s")), color=color,
                           label=f"{run.label} exposed"))
        drawn.append(_line(ax, run.series("comm_s", _ratio("comm_s")), color=color, linestyle="--",
                           label=f"{run.label} in flight"))
    ax.set_title("communication (% of step time)")
    if not any(drawn):
        _note(ax, NO_COMM)


def _note(ax, text: str) -> None:
    """Say in the panel why it is empty (and drop the meaningless axis ticks)."""
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", wrap=True, fontsize=9, color="0.3")
    ax.set_yticks([])


# (file stem, drawing function), in the order of the combined figure's panels
PANELS: tuple[tuple[str, Callable], ...] = (
    ("loss", _loss),
    ("lr", _simple("lr", "learning rate")),
    ("tokens_per_s", _simple("tokens_per_s", "tokens/s")),
    ("mfu", _simple("mfu", "MFU (%)", lambda row, v: 100.0 * v, empty=MFU_UNKNOWN)),
    ("memory", _memory),
    ("comm", _comm),
)


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError("disttrain plot needs matplotlib: pip install 'disttrain[plot]'") from None
    return Figure, FigureCanvasAgg


def _finish(ax) -> None:
    ax.set_xlabel("step")
    ax.ticklabel_format(axis="y", useOffset=False)  # 0.3184 GiB, not "+3.183e-1" over the axis
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def figure(runs: list[Run], panels=PANELS, grid: tuple[int, int] = (1, 1), size=(7, 4.5)):
    """A matplotlib Figure (Agg canvas) with one axes per panel, on a `grid` of rows x columns."""
    figure_cls, canvas_cls = _matplotlib()
    fig = figure_cls(figsize=size, layout="constrained")
    canvas_cls(fig)
    axes = fig.subplots(*grid, squeeze=False).flat
    colors = [f"C{i % 10}" for i in range(len(runs))]
    for ax, (_, draw) in zip(axes, panels, strict=False):
        draw(ax, runs, colors)
        _finish(ax)
    return fig


def plot_runs(run_dirs: list[Path], out: Path | None = None) -> list[Path]:
    """Draw the runs' metrics into `out` (default: the first run's `plots/`); the paths written, the combined figure
    first."""
    runs = [Run(label, read_run(d)) for d, label in zip(run_dirs, labels(run_dirs), strict=True)]
    _matplotlib()  # before anything is written
    out = Path(out) if out is not None else Path(run_dirs[0]) / "plots"
    make_folder(out, "--out")
    if not os.access(out, os.W_OK):
        raise ConfigError(f"--out '{out}': the folder is not writable; pass a folder you can write")
    combined = figure(runs, PANELS, grid=(2, 3), size=(16, 9))
    combined.suptitle(", ".join(run.label for run in runs))
    figures = [("plot", combined)] + [(name, figure(runs, [(name, draw)])) for name, draw in PANELS]
    written = []
    for name, fig in figures:
        written.append(out / f"{name}.png")
        fig.savefig(written[-1], dpi=100)
    return written


def run(run_dirs: list[str], out: str | None) -> int:
    for path in plot_runs([Path(d) for d in run_dirs], Path(out) if out else None):
        print(path)
    return 0

