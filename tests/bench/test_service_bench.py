"""Smoke tests of the service and wire benchmarks (their figures are reported, never asserted)."""

import json

from disttrain.bench import service, wire


def test_service_benchmark_runs_and_saves_its_figures(tmp_path):
    assert service.main(["--repeats", "1", "--steps", "4", "--warmup", "1", "--out", str(tmp_path)]) == 0
    figures = json.loads((tmp_path / "service.json").read_text())
    assert len(figures["train_ms"]) == len(figures["service_ms"]) == 1 and figures["median_ratio"] > 0
    assert "median ratio" in (tmp_path / "service.md").read_text()


def test_wire_benchmark_sends_every_byte_of_the_batch(tmp_path):
    assert wire.main(["--nproc", "2", "--mib", "2", "--repeats", "1", "--out", str(tmp_path)]) == 0
    figures = json.loads((tmp_path / "wire.json").read_text())
    assert figures["bytes"] == 2 * 2**20 and figures["MB_per_s"] > 0  # the workers' slices add up to the batch
    assert "MB/s" in (tmp_path / "wire.md").read_text()


def test_weight_sync_benchmark_sends_the_model_to_each_engine(tmp_path):
    from disttrain.bench import weight_sync

    assert weight_sync.main(["--layers", "1", "--d-model", "64", "--repeats", "1", "--dtype", "float32",
                             "--out", str(tmp_path)]) == 0
    figures = json.loads((tmp_path / "weight_sync.json").read_text())
    # the model's float32 bytes (and a safetensors header per bucket) reach the engines once per version
    params = figures["model_bytes"] / 4
    assert 60_000 < params < 70_000, params
    assert figures["ratio"] > 0 and 0 < figures["delta_bytes"]
    assert "delta after one optimizer step" in (tmp_path / "weight_sync.md").read_text()
