"""`disttrain bench comm` at 2 ranks with tiny sizes (its figures are reported, never asserted), the report without
matplotlib, and bad input (one line, exit 2)."""

import csv
import importlib.util
import json
import os
import sys
import threading

import pytest

from conftest import run_cli
from disttrain.bench import comm, comm_report
from disttrain.bench import interconnect as ic
from disttrain.cli.main import main as cli
from disttrain.errors import ConfigError

SCHEDSTAT = os.path.isfile(f"/proc/self/task/{threading.get_native_id()}/schedstat")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("comm")
    result = run_cli(["bench", "comm", "--nproc", "2", "--min-size", "1K", "--max-size", "64K", "--iters", "3",
                      "--min-iters", "2", "--warmup", "1", "--out", str(tmp / "b")], tmp, timeout=120)
    assert result.returncode == 0, result.stderr
    return tmp / "b", result


def test_table_columns_and_bus_bandwidth_follow_the_measured_time(run):
    out, result = run
    rows = list(csv.DictReader(open(out / "comm.csv")))
    assert list(rows[0]) == ["collective", "dtype", "bytes", "world_size", "backend", "iterations", "time_median_s",
                             "time_mean_s", "time_min_s", "algbw_GBps", "busbw_GBps",
                             *(["cpu_median_s", "cpu_mean_s"] if SCHEDSTAT else [])]
    assert [r["collective"] for r in rows[::4]] == list(comm.COLLECTIVES)  # 1K, 4K, 16K, 64K each
    assert {int(r["bytes"]) for r in rows} == {1024, 4096, 16384, 65536}
    assert {r["dtype"] for r in rows} == {"float32"}  # (the default)
    factor = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5, "broadcast": 1.0, "all_to_all": 0.5}
    for r in rows:
        t = float(r["time_median_s"])
        assert r["world_size"] == "2" and r["backend"] == "gloo" and 0 < float(r["time_min_s"]) <= t
        assert float(r["time_min_s"]) <= float(r["time_mean_s"])
        assert float(r["algbw_GBps"]) == pytest.approx(int(r["bytes"]) / t / 1e9, rel=1e-9)
        assert float(r["busbw_GBps"]) == pytest.approx(float(r["algbw_GBps"]) * factor[r["collective"]], rel=1e-9)
    raw = json.loads((out / "comm_raw.json").read_text())
    assert all(len(r["times_s"]) == r["iterations"] == 3 for r in raw["rows"])
    if SCHEDSTAT:  # (Linux's per-thread CPU times)
        assert all(len(r["cpu_s"]) == 3 and min(r["cpu_s"]) > 0 for r in raw["rows"])  # gloo's threads worked
    assert "| all_to_all | 64K | 65536 | 3 |" in result.stdout
    assert (out / "comm.png").is_file() == (importlib.util.find_spec("matplotlib") is not None)


def test_fit_is_sane(run):
    out, _ = run
    fit = json.loads((out / "comm_fit.json").read_text())
    assert fit["backend"] == "gloo" and fit["world_size"] == 2 and fit["host"] and fit["date"]
    assert set(fit["collectives"]) == set(comm.COLLECTIVES)
    rows = list(csv.DictReader(open(out / "comm.csv")))
    for c, f in fit["collectives"].items():
        times = [float(r["time_median_s"]) for r in rows if r["collective"] == c]
        assert f["alpha_s"] >= 0 and f["beta_s_per_byte"] >= 0 and f["alpha_s"] + f["beta_s_per_byte"] > 0
        if SCHEDSTAT:  # gloo's threads' CPU time per call, fitted the same way
            assert f["cpu_alpha_s"] >= 0 and f["cpu_beta_s_per_byte"] >= 0
            assert f["cpu_alpha_s"] + f["cpu_beta_s_per_byte"] > 0
        assert f["alpha_s"] <= max(times)  # latency cannot exceed the slowest call it was fitted to
        assert f["max_rel_error"] == pytest.approx(max(
            abs(f["alpha_s"] + f["beta_s_per_byte"] * int(r["bytes"]) - float(r["time_median_s"]))
            / float(r["time_median_s"]) for r in rows if r["collective"] == c), rel=1e-9)


def test_each_dtype_is_timed_and_fitted_and_the_scale_model_prices_its_bytes_with_it(tmp_path):
    result = run_cli(["bench", "comm", "--nproc", "2", "--collectives", "all_reduce,all_gather,reduce_scatter",
                      "--dtype", "float32,bfloat16", "--min-size", "1K", "--max-size", "4K", "--iters", "3",
                      "--min-iters", "2", "--warmup", "1", "--out", str(tmp_path / "b")], tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    rows = list(csv.DictReader(open(tmp_path / "b" / "comm.csv")))
    assert [(r["dtype"], r["collective"], r["bytes"]) for r in rows] == [
        (d, c, b) for d in ("float32", "bfloat16") for c in ("all_reduce", "all_gather", "reduce_scatter")
        for b in ("1024", "4096")]
    fit = json.loads((tmp_path / "b" / "comm_fit.json").read_text())
    assert fit["dtype"] == "float32" and set(fit["dtypes"]) == {"bfloat16"}
    for c, f in fit["dtypes"]["bfloat16"].items():  # bfloat16's own calls, fitted as float32's are
        times = [float(r["time_median_s"]) for r in rows if (r["dtype"], r["collective"]) == ("bfloat16", c)]
        assert f["max_rel_error"] == pytest.approx(max(abs(f["alpha_s"] + f["beta_s_per_byte"] * b - t) / t
                                                       for b, t in zip((1024, 4096), times, strict=True)), rel=1e-9)
    assert "| all_reduce (bfloat16) | 4K | 4096 | 3 |" in result.stdout and "float32, bfloat16 buffers" in result.stdout
    net = ic.interconnect_from_fit(fit)
    assert net.for_dtype("bfloat16", "all_reduce") == net.dtypes["bfloat16"]
    assert net.for_dtype("float16", "all_reduce") is net  # not measured in float16: float32's links
    bf16 = fit["dtypes"]["bfloat16"]["all_reduce"]
    assert ic.collective_time("all_reduce", 4096, 2, net.for_dtype("bfloat16", "all_reduce")) == pytest.approx(
        bf16["alpha_s"] + bf16["beta_s_per_byte"] * 4096, rel=1e-9)


def test_a_fit_of_one_other_dtype_says_so_and_prices_every_element_type(tmp_path):
    raw = {"world_size": 2, "backend": "gloo", "device": "cpu", "devices": [], "host": "h", "machine": "m",
           "torch": "t", "date": "d", "warmup": 1, "other_cpu": 0.0, "dtypes": ["bfloat16"],
           "rows": [{"collective": c, "dtype": "bfloat16", "bytes": b, "iterations": 2,
                     "times_s": [1e-3 + b * 1e-9] * 2}
                    for c in ("all_reduce", "all_gather", "reduce_scatter") for b in (1024, 4096)]}
    comm_report.report(raw, tmp_path)
    fit = json.loads((tmp_path / "comm_fit.json").read_text())
    assert fit["dtype"] == "bfloat16" and "dtypes" not in fit
    text = (tmp_path / "comm.md").read_text()
    assert "| all_reduce (bfloat16) | 1K |" in text and "| all_reduce (bfloat16) | 1000.0 |" in text
    net = ic.interconnect_from_fit(fit)
    assert "measured in bfloat16, which prices every element type's bytes" in net.note
    assert net.for_dtype("float32", "all_reduce") is net
    partial = {**fit, "dtype": "float32", "dtypes": {"bfloat16": {"all_reduce": fit["collectives"]["all_reduce"]}}}
    with pytest.raises(ConfigError, match=r"measured \(bfloat16\): the fit has no all_gather, reduce_scatter"):
        ic.interconnect_from_fit(partial)  # (a hierarchical all-reduce runs all three)


def test_report_without_matplotlib_writes_everything_else(run, tmp_path, monkeypatch, capsys):
    out, _ = run
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    comm_report.report(json.loads((out / "comm_raw.json").read_text()), tmp_path)
    assert capsys.readouterr().err.strip() == "disttrain: comm.png not written: pip install 'disttrain[plot]'"
    assert {p.name for p in tmp_path.iterdir()} == {"comm.csv", "comm.md", "comm_fit.json"}
    assert "pip install 'disttrain[plot]'" in (tmp_path / "comm.md").read_text()


@pytest.mark.parametrize("args, message", [
    (["--collectives", "all_reduce,allreduce"], "--collectives: allreduce unknown; choose from all_reduce, "),
    (["--collectives", ","], "--collectives: none given; choose from all_reduce, "),
    (["--min-size", "1KB"], "--min-size '1KB' is not a size"),
    (["--max-size", "lots"], "--max-size 'lots' is not a size"),
    (["--min-size", "1M", "--max-size", "1K"], "--min-size 1M is above --max-size 1K"),
    (["--nproc", "1000"], "--nproc 1000: more ranks than this machine can start"),
    (["--nproc", "1"], "--nproc 1: a collective needs at least 2 ranks"),
    (["--busy", "step", "--compute-ms", "-1"], "--compute-ms -1: give milliseconds >= 0"),
    (["--busy", "step", "--compute-ms", "nan"], "--compute-ms nan: give milliseconds >= 0"),
    (["--compute-ms", "20"], "--compute-ms 20 applies to --busy step only"),
    (["--dtype", "float32,float64"], "--dtype 'float32,float64': float64; choose from float32, bfloat16, float16"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    assert cli(["bench", "comm", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("disttrain: error: " + message) and "\n" not in err, err


def test_backend_threads_cpu_time_is_none_where_no_thread_can_be_read(monkeypatch):
    import disttrain.bench as bench

    monkeypatch.setattr(bench.os, "listdir", lambda path: ["999999999"])  # a thread that is gone: no schedstat
    assert bench.backend_threads_seconds() is None
    monkeypatch.setattr(bench.os, "listdir", lambda path: [])  # no thread Python did not start
    assert bench.backend_threads_seconds() is None
