"""The launcher's terminal under `--nproc N`: the workers' output, line by line, and one live progress bar.

torchrun writes each worker's stdout and stderr to files (`--redirects 3`); a `Console` thread in the launcher
tails those files and prints each complete line with its rank (`[rank 1] ...`), and, for `disttrain train`, draws
rank 0's progress from `metrics.jsonl` (the line rank 0 appends every logged step) as one bar at the bottom of a
terminal: before a worker's line the bar is cleared, after it the bar is drawn again, so log lines never tear it.
On a pipe the bar is a periodic line (`metrics.ProgressBar`). Workers started this way draw no bar of their own
(`DISTTRAIN_LAUNCHER_DRAWS` in their environment).
"""

from __future__ import annotations

import json
import re
import sys
import threading
from pathlib import Path
from typing import TextIO

from disttrain.metrics import ProgressBar

DRAWS_ENV = "DISTTRAIN_LAUNCHER_DRAWS"
"""Set in the workers' environment when the launcher draws the progress bar."""

_RANK_DIR = re.compile(r"attempt_(\d+)[/\\](\d+)[/\\](stdout|stderr)\.log$")


class Console(threading.Thread):
    """Tails the workers' log files under `log_dir` and draws the bar of `metrics` (if `total`)."""

    def __init__(self, log_dir: Path, metrics: Path | None, total: int, out: TextIO | None = None,
                 err: TextIO | None = None, poll_s: float = 0.2):
        super().__init__(name="disttrain-console", daemon=True)
        # the streams of now, not of import time (a caller such as pytest may have replaced them since)
        out, err = out or sys.stdout, err or sys.stderr
        self.log_dir, self.metrics, self.out, self.err, self.poll_s = log_dir, metrics, out, err, poll_s
        self.bar = ProgressBar(total, stream=err) if metrics is not None and total > 0 else None
        # a run folder used before keeps the earlier launches' logs and metrics: what is there now is not shown
        self._offsets: dict[Path, int] = {p: ident[1] for p in _logs(log_dir) if (ident := _identity(p))}
        self._partial: dict[Path, str] = {}
        self._metrics_offset = 0
        self._stale = _identity(metrics) if metrics is not None else None
        """The metrics file as the previous run left it: ignored until rank 0 rewrites it."""
        self._last_step = 0
        self._drawn = ""  # the bar now on the terminal (tty only)
        self._halt = threading.Event()
        self._lock = threading.Lock()

    def run(self) -> None:
        while not self._halt.wait(self.poll_s):
            self.pump()

    def stop(self) -> None:
        """Print what is left (every complete line), end the bar's line; call when the workers are done."""
        self._halt.set()
        if self.is_alive():
            self.join()
        self.pump(final=True)
        with self._lock:
            if self._drawn:
                self.err.write("\n")
                self.err.flush()
                self._drawn = ""

    def pump(self, final: bool = False) -> None:
        with self._lock:
            lines = self._new_lines(final)
            if lines:
                self._clear()
                for stream, line in lines:
                    stream.write(line + "\n")
                self.out.flush()
                self.err.flush()
            self._progress()
            self._redraw()

    # -- worker output ----------------------------------------------------------------------------------

    def _new_lines(self, final: bool) -> list[tuple[TextIO, str]]:
        out = []
        for path in _logs(self.log_dir):
            match = _RANK_DIR.search(str(path))
            if match is None:
                continue
            try:
                with path.open("rb") as f:
                    f.seek(self._offsets.get(path, 0))
                    data = f.read()
            except OSError:
                continue
            self._offsets[path] = self._offsets.get(path, 0) + len(data)
            text = self._partial.pop(path, "") + data.decode(errors="replace")
            *complete, rest = text.split("\n")
            if rest and final:
                complete.append(rest)
            elif rest:
                self._partial[path] = rest
            stream = self.out if match.group(3) == "stdout" else self.err
            out += [(stream, f"[rank {match.group(2)}] {line}") for line in complete]
        return out

    # -- the bar ---------------------------------------------------------------------------------------------

    def _progress(self) -> None:
        if self.bar is None or not self.metrics.is_file():
            return
        if self._stale is not None:
            if _identity(self.metrics) == self._stale:
                return
            self._stale = None
        try:
            with self.metrics.open("rb") as f:
                size = f.seek(0, 2)
                if size < self._metrics_offset:  # rank 0 rewrote it (a resumed run keeps its earlier lines)
                    self._metrics_offset = 0
                f.seek(self._metrics_offset)
                data = f.read()
        except OSError:
            return
        complete = data[:data.rfind(b"\n") + 1]
        self._metrics_offset += len(complete)
        records = []
        for line in complete.decode(errors="replace").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        if self._last_step == 0 and records:
            # The rate and ETA count from the newest line of the first read: neither start-up nor the lines a resumed
            # run kept from before (read here at once) are in them, and only that newest line is drawn.
            records = records[-1:]
            self.bar.restart(int(records[0].get("step", 0)))
        for record in records:
            step = int(record.get("step", 0))
            if step <= self._last_step:
                continue
            self._last_step = step
            if self.bar.tty:
                self._drawn = self.bar.render(step, record)
            else:
                self.bar.update(step, record)

    def _clear(self) -> None:
        if self._drawn:
            self.err.write("\r\x1b[K")

    def _redraw(self) -> None:
        if self._drawn:
            self.err.write("\r" + self._drawn + "\x1b[K")
            self.err.flush()


def _logs(log_dir: Path) -> list[Path]:
    return sorted(log_dir.rglob("*.log")) if log_dir.is_dir() else []


def _identity(path: Path) -> tuple[int, int, int] | None:
    """(inode, size, modification time): changes when the file is rewritten, replaced or appended to."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns
