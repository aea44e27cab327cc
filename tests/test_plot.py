"""`disttrain plot`: the figures of two real runs overlaid, and its one-line refusals."""

import json
import subprocess
import sys
import zlib

import pytest

from conftest import DISTTRAIN, cli_env, run_cli
from disttrain.cli.plot import MFU_UNKNOWN, NO_COMM, PANELS, Run, figure, labels, read_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TINY = ["--set", "model.n_layer=1", "--set", "model.d_model=32", "--set", "model.n_head=2", "--set", "model.seq_len=16",
        "--set", "train.steps=6", "--set", "train.eval_every=3", "--set", "train.eval_samples=16",
        "--set", "log.progress=false", "--set", "checkpoint.every=0", "--set", "train.log_every=1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two 6-step runs of a tiny GPT on one process, trained side by side: `single`, and `ddp` (a one-rank gloo group,
    so its lines carry communication figures)."""
    root = tmp_path_factory.mktemp("plot")
    procs = [subprocess.Popen(DISTTRAIN + ["train", *TINY, "--set", f"run.out_dir={root}", "--set", f"run.name={name}",
                                           "--set", f"parallel.strategy={strategy}"],
                              cwd=root, env=cli_env(root), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, strategy in (("single_run", "single"), ("ddp_run", "ddp"))]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    return root / "single_run", root / "ddp_run"


def png_size(path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk, after checking the signature and the chunk's CRC."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR" and zlib.crc32(data[12:29]) == int.from_bytes(data[29:33], "big")
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_two_runs_overlaid_as_png_files(runs, tmp_path):
    """Without --out the files go to the first run's plots/ folder."""
    single, ddp = runs
    lines = read_run(ddp)
    assert len(lines) == 6 and any("eval_loss" in line for line in lines)
    assert all(line["comm_s"] is not None for line in lines)  # the comm panel has something to draw
    out = single / "plots"
    result = run_cli(["plot", str(single), str(ddp)], tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    expected = [out / f"{name}.png" for name in ["plot", *(stem for stem, _ in PANELS)]]
    assert result.stdout.split() == [str(p) for p in expected]  # the paths written, printed
    assert len(expected) == 7
    for path in expected:
        width, height = png_size(path)
        assert width >= 600 and height >= 400
        assert path.stat().st_size > 10_000  # drawn, not a blank canvas (a blank 700x450 PNG is ~3 KB)
    combined = png_size(out / "plot.png")
    assert combined[0] > png_size(out / "loss.png")[0]


def test_empty_panels_say_why(runs):
    """On a CPU every `mfu` is null: the MFU panel says what it needs; without a process group no collective was
    timed. A run that has the figures draws them and no note."""
    single, ddp = runs
    assert all(json.loads(line)["mfu"] is None for line in (single / "metrics.jsonl").read_text().splitlines())
    fig = figure([Run("single", read_run(single))], PANELS, grid=(2, 3))
    notes = {ax.get_title(): [t.get_text() for t in ax.texts] for ax in fig.axes}
    assert notes["MFU (%)"] == [MFU_UNKNOWN] and notes["communication (% of step time)"] == [NO_COMM]
    assert notes["loss"] == [] and len(fig.axes[0].lines) == 2  # train loss and eval points
    fig = figure([Run("ddp", read_run(ddp))], PANELS, grid=(2, 3))
    comm = fig.axes[5]
    assert len(comm.texts) == 0 and [line.get_linestyle() for line in comm.lines] == ["-", "--"]


def test_labels_tell_same_named_runs_apart(tmp_path):
    dirs = [tmp_path / "a" / "run", tmp_path / "b" / "run", tmp_path / "c" / "other"]
    assert labels(dirs) == ["a/run", "b/run", "other"]


def _refused(result, *words):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for word in words:
        assert word in lines[0], lines[0]


def test_bad_input_is_one_line(runs, tmp_path):
    _refused(run_cli(["plot", str(tmp_path / "nowhere")], tmp_path, timeout=60), "nowhere", "does not exist")
    (tmp_path / "empty_run").mkdir()
    _refused(run_cli(["plot", str(tmp_path / "empty_run")], tmp_path, timeout=60), "no metrics.jsonl")
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    good = (runs[0] / "metrics.jsonl").read_text().splitlines()
    (damaged / "metrics.jsonl").write_text("\n".join([good[0], good[1], '{"step": 3, "loss": 5.4', good[3]]) + "\n")
    _refused(run_cli(["plot", str(runs[0]), str(damaged)], tmp_path, timeout=60),
             str(damaged / "metrics.jsonl"), "line 3", "not JSON")
    (damaged / "metrics.jsonl").write_bytes(b"\xff\xfe{}\n")
    _refused(run_cli(["plot", str(damaged)], tmp_path, timeout=60), "cannot read it (not UTF-8 text)")
    (tmp_path / "a_file").write_text("")
    _refused(run_cli(["plot", str(runs[0]), "--out", str(tmp_path / "a_file")], tmp_path, timeout=60),
             "--out", "cannot create the folder")


def test_without_matplotlib_says_how_to_install(runs, tmp_path):
    """matplotlib hidden from the import system (None in sys.modules makes `import matplotlib` fail)."""
    code = ("import sys; sys.modules['matplotlib'] = None; from disttrain.cli.main import main; "
            f"sys.exit(main(['plot', {str(runs[0])!r}, '--out', {str(tmp_path / 'out')!r}]))")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=cli_env(tmp_path), capture_output=True,
                            text=True, timeout=60)
    _refused(result, "pip install 'disttrain[plot]'")
    assert not (tmp_path / "out").exists()
