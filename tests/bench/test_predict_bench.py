"""`disttrain bench predict`: the forecast table, the validation against a measured CSV and the published cases,
the measuring mode (one sitting on 1 and 2 ranks: step times, links, the check), and bad input (one line, exit 2)."""

import argparse
import csv
import json
from dataclasses import replace

import pytest

from conftest import run_cli
from disttrain.bench import interconnect as ic
from disttrain.bench import model_split, predict, predict_job, predict_measure, predict_validate
from disttrain.bench import scale_model as sm
from disttrain.bench.model_shapes import MODELS
from disttrain.bench.predict_job import counted_shape
from disttrain.bench.published_scaling import PUBLISHED
from disttrain.cli.main import main as cli
from disttrain.config import ModelConfig, load_config

FIT = {"backend": "gloo", "world_size": 2, "device": "cpu", "host": "h", "date": "d",
       "collectives": {c: {"alpha_s": 4e-4, "beta_s_per_byte": 1e-9} for c in ic.COLLECTIVES}}
TINY = ["--set", "model.n_layer=2", "--set", "model.d_model=64", "--set", "model.n_head=4", "--set",
        "model.seq_len=32"]
SHAPE = counted_shape(ModelConfig(n_layer=2, d_model=64, n_head=4, seq_len=32))  # TINY's model, counted


def test_forecast_writes_the_table(tmp_path, capsys):
    assert cli(["bench", "predict", "--model", "llama3-8b", "--strategy", "ddp,zero3", "--gpus", "64,8",
                "--mfu", "0.4", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "predict.csv")))
    assert [(r["strategy"], r["gpus"]) for r in rows] == [("ddp", "8"), ("ddp", "64"), ("fsdp", "8"), ("fsdp", "64")]
    work = sm.Workload(MODELS["llama3-8b"], sm.compute_seconds(MODELS["llama3-8b"], 2 * 8192, 989, 0.4), 16384)
    expected = sm.step_time("fsdp", 64, work, ic.PRESETS["h100-nvlink+ib-ndr"])
    assert float(rows[3]["step_s"]) == pytest.approx(expected.step_s, rel=1e-9)
    assert float(rows[2]["efficiency"]) == 1.0 and float(rows[3]["efficiency"]) < 1.0
    assert "| fsdp | 64 |" in (tmp_path / "predict.md").read_text() and "| fsdp | 64 |" in capsys.readouterr().out


def test_forecast_of_a_config_counts_what_model_freeze_leaves_to_reduce(tmp_path):
    for name, settings in (("all", []), ("frozen", ["--set", "model.freeze=tok_emb.*,pos_emb.*,blocks.0.*"])):
        assert cli(["bench", "predict", *TINY, *settings, "--strategy", "ddp,fsdp", "--gpus", "8,64", "--compute-s",
                    "0.1", "--out", str(tmp_path / name)]) == 0
    rows = {name: {(r["strategy"], r["gpus"]): float(r["wire_bytes_per_gpu"])
                   for r in csv.DictReader(open(tmp_path / name / "predict.csv"))} for name in ("all", "frozen")}
    assert rows["all"].keys() == rows["frozen"].keys() and len(rows["all"]) == 4
    assert all(rows["frozen"][key] < rows["all"][key] for key in rows["all"])
    frozen = 1 - (SHAPE.units()[2].params + 2 * 64) / SHAPE.params  # all but block 1 and the final norm
    assert f"{frozen:.1%} of the parameters frozen (model.freeze" in (tmp_path / "frozen" / "predict.md").read_text()


def test_a_sweep_of_hsdp_s_shard_size_models_what_each_value_runs(tmp_path):
    """The config's hsdp with shard size 0 runs plain FSDP: the swept value 0 is fsdp, 2 is hsdp."""
    assert cli(["bench", "predict", *TINY, "--set", "parallel.strategy=hsdp", "--gpus", "2,4", "--compute-s", "0.1",
                "--sweep", "parallel.hsdp_shard_size=0,2", "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader(open(tmp_path / "predict.csv")))
    assert [(r["strategy"], r["setting"], r["gpus"]) for r in rows] == [
        ("fsdp", "parallel.hsdp_shard_size=0", "2"), ("fsdp", "parallel.hsdp_shard_size=0", "4"),
        ("hsdp", "parallel.hsdp_shard_size=2", "2"), ("hsdp", "parallel.hsdp_shard_size=2", "4")]
    assert rows[0]["step_s"] == rows[2]["step_s"] and rows[1]["step_s"] != rows[3]["step_s"]  # (one group at 2)


def test_forecast_of_a_powersgd_job_sends_its_factors(tmp_path):
    for name, settings in (("none", []), ("powersgd", ["--set", "parallel.grad_compression=powersgd", "--set",
                                                       "parallel.powersgd_rank=2"])):
        assert cli(["bench", "predict", *TINY, *settings, "--strategy", "ddp", "--gpus", "8,64", "--compute-s", "0.1",
                    "--out", str(tmp_path / name)]) == 0
    rows = {name: [float(r["wire_bytes_per_gpu"]) for r in csv.DictReader(open(tmp_path / name / "predict.csv"))]
            for name in ("none", "powersgd")}
    assert all(low < plain for low, plain in zip(rows["powersgd"], rows["none"], strict=True))
    assert "gradient compression powersgd: bytes per element stored / gathered / reduced 4 / 4 / 4 (DDP's buckets " \
           "as rank-2 factors)" in (tmp_path / "powersgd" / "predict.md").read_text()


def test_a_job_on_several_nodes_shares_its_global_batch_over_every_node_s_ranks(tmp_path):
    assert cli(["bench", "predict", *TINY, "--set", "data.global_batch_size=64", "--nodes", "2", "--strategy", "ddp",
                "--gpus", "8", "--compute-s", "0.1", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "predict.md").read_text()
    assert "32 x 32 tokens per GPU per step (the config's: data.global_batch_size 64 over dist.nproc 1 x 2 nodes; " \
           "4 micro-batches of 8" in text


def test_a_forecast_sweeps_a_setting_of_the_collectives_in_one_table(tmp_path):
    assert cli(["bench", "predict", *TINY, "--strategy", "ddp,fsdp", "--gpus", "8,64", "--compute-s", "0.1",
                "--sweep", "parallel.grad_compression=none,powersgd", "--out", str(tmp_path / "swept")]) == 0
    swept = list(csv.DictReader(open(tmp_path / "swept" / "predict.csv")))
    assert [(r["strategy"], r["setting"], r["gpus"]) for r in swept] == [
        ("ddp", "parallel.grad_compression=none", "8"), ("ddp", "parallel.grad_compression=none", "64"),
        ("fsdp", "parallel.grad_compression=none", "8"), ("fsdp", "parallel.grad_compression=none", "64"),
        ("ddp", "parallel.grad_compression=powersgd", "8"), ("ddp", "parallel.grad_compression=powersgd", "64")]
    for value, at in (("none", 1), ("powersgd", 5)):  # each value's rows are its own forecast's
        assert cli(["bench", "predict", *TINY, "--strategy", "ddp", "--gpus", "8,64", "--compute-s", "0.1", "--set",
                    f"parallel.grad_compression={value}", "--out", str(tmp_path / value)]) == 0
        alone = list(csv.DictReader(open(tmp_path / value / "predict.csv")))
        assert swept[at]["step_s"] == alone[1]["step_s"] and swept[at]["wire_bytes_per_gpu"] == \
            alone[1]["wire_bytes_per_gpu"]
    text = (tmp_path / "swept" / "predict.md").read_text()
    assert "| ddp | parallel.grad_compression=powersgd | 64 |" in text and "- swept: parallel.grad_compression" in text
    assert "Not predicted: fsdp with parallel.grad_compression=powersgd (parallel.grad_compression = 'powersgd' is " \
           "a DDP communication hook" in text


@pytest.mark.parametrize("settings, expected", [
    (["parallel.strategy=auto"], "ddp"),  # (what auto runs on several ranks)
    (["parallel.strategy=zero1"], "zero1"),
    (["parallel.strategy=deepspeed"], "zero2"),  # its default stage
    (["parallel.strategy=deepspeed", "parallel.deepspeed_stage=3"], "fsdp"),
    (["parallel.strategy=fsdp", "parallel.reshard_after_forward=false"], "zero2"),  # gathered once, kept for backward
    (["parallel.strategy=hsdp"], "fsdp"),  # hsdp_shard_size 0: one sharding group of every rank
    (["parallel.strategy=hsdp", "parallel.hsdp_shard_size=4"], "hsdp"),
])
def test_the_strategy_is_the_one_the_config_s_job_runs(settings, expected, tmp_path):
    sets = [x for setting in settings for x in ("--set", setting)]
    assert cli(["bench", "predict", *TINY, *sets, "--gpus", "8", "--out", str(tmp_path)]) == 0
    assert {r["strategy"] for r in csv.DictReader(open(tmp_path / "predict.csv"))} == {expected}
    strategy = settings[0].partition("=")[2]
    assert f"the config's parallel.strategy = '{strategy}', modelled as {expected}" in \
        (tmp_path / "predict.md").read_text()


def test_forecast_takes_the_config_s_compression_and_buckets(tmp_path):
    preset = ["--model", "llama3-8b", "--strategy", "ddp", "--gpus", "8,64"]  # a preset takes the config's settings
    for name, settings in (("preset", []), ("preset_bf16", ["--set", "parallel.grad_compression=bf16"])):
        assert cli(["bench", "predict", *preset, *settings, "--out", str(tmp_path / name)]) == 0
    wire = {name: float(list(csv.DictReader(open(tmp_path / name / "predict.csv")))[1]["wire_bytes_per_gpu"])
            for name in ("preset", "preset_bf16")}
    assert wire["preset_bf16"] == pytest.approx(wire["preset"] - 2 * 63 / 64 * MODELS["llama3-8b"].params * 2,
                                                rel=1e-9)
    runs = {"plain": [], "bf16": ["--set", "parallel.grad_compression=bf16"],
            "buckets": ["--set", "parallel.bucket_cap_mb=0.01", "--set", "train.log_every=1"]}
    for name, settings in runs.items():
        assert cli(["bench", "predict", *TINY, *settings, "--strategy", "ddp", "--gpus", "1,2", "--compute-s", "0.1",
                    "--interconnect", "v100-nvlink+100gbe", "--out", str(tmp_path / name)]) == 0
    rows = {name: list(csv.DictReader(open(tmp_path / name / "predict.csv")))[1] for name in runs}
    work = sm.Workload(SHAPE, 0.1, 1, "fp32", micro_steps=4)  # (the built-in job: 32 sequences in micro-batches of 8)
    net = ic.PRESETS["v100-nvlink+100gbe"]
    for name, expected in (("plain", work), ("bf16", replace(work, grad_compression="bf16")),
                           ("buckets", replace(work, bucket_bytes=0.01 * 2**20, log_every=1))):
        assert float(rows[name]["step_s"]) == pytest.approx(sm.step_time("ddp", 2, expected, net).step_s, rel=1e-9)
    assert float(rows["bf16"]["wire_bytes_per_gpu"]) < float(rows["plain"]["wire_bytes_per_gpu"])
    assert "gradient compression bf16: bytes per element stored / gathered / reduced 4 / 4 / 2; DDP buckets of 25 " \
        "MiB" in (tmp_path / "bf16" / "predict.md").read_text()
    assert "DDP buckets of 0.01 MiB; a logged line every 1 steps" in (tmp_path / "buckets" / "predict.md").read_text()


def test_forecast_of_a_config_takes_its_batch_per_gpu_and_accumulation(tmp_path):
    """The built-in job's 32 sequences on 1 rank in micro-batches of 8 (gradients reduced on the 4th), or on 4 ranks
    (8 each, no accumulation); flags override the config's."""
    runs = {"one": ([], 32, 4), "four": (["--set", "dist.nproc=4"], 8, 1),
            "flags": (["--local-batch", "12", "--micro-batch", "3"], 12, 4), "local": (["--local-batch", "6"], 6, 1)}
    net = ic.PRESETS["v100-nvlink+100gbe"]
    for name, (flags, local, micro_steps) in runs.items():
        assert cli(["bench", "predict", *TINY, *flags, "--strategy", "ddp,fsdp", "--gpus", "1,16", "--compute-s",
                    "0.1", "--interconnect", "v100-nvlink+100gbe", "--out", str(tmp_path / name)]) == 0
        rows = list(csv.DictReader(open(tmp_path / name / "predict.csv")))
        work = sm.Workload(SHAPE, 0.1, local * 32, "fp32", micro_steps=micro_steps)
        for row in rows:
            expected = sm.step_time(row["strategy"], int(row["gpus"]), work, net)
            assert float(row["step_s"]) == pytest.approx(expected.step_s, rel=1e-9)
            assert float(row["tokens_per_s_per_gpu"]) == pytest.approx(local * 32 / expected.step_s, rel=1e-9)
    comm = {name: [float(r["comm_s"]) for r in csv.DictReader(open(tmp_path / name / "predict.csv"))]
            for name in ("one", "four")}
    assert comm["one"][1] == comm["four"][1]  # ddp reduces once a step, accumulated or not;
    assert comm["one"][3] > 2 * comm["four"][3]  # fsdp gathers again for each micro-batch (4 x), reduces once
    assert "32 x 32 tokens per GPU per step (the config's: data.global_batch_size 32 over dist.nproc 1, one node's " \
        "ranks; 4 micro-batches of 8: gradients reduced on the last)" in (tmp_path / "one" / "predict.md").read_text()


def validate(tmp_path, measured_csv: str) -> list[dict]:
    """`bench predict --validate` of the tiny GPT against `measured_csv` and FIT: the rows of predict.csv."""
    (tmp_path / "comm_fit.json").write_text(json.dumps(FIT))
    (tmp_path / "scaling.csv").write_text(measured_csv)
    assert cli(["bench", "predict", "--validate", *TINY, "--measured", str(tmp_path / "scaling.csv"),
                "--interconnect", f"measured:{tmp_path}", "--cpu-cores", "2", "--out", str(tmp_path)]) == 0
    return list(csv.DictReader(open(tmp_path / "predict.csv")))


def test_validate_against_a_minimal_csv_and_the_published_cases(tmp_path):
    rows = validate(tmp_path, "strategy,world_size,step_time_s\nddp,1,0.1\nddp,2,0.12\nfsdp,1,0.1\nfsdp,2,0.2\n"
                              "single,1,0.1\n")
    measured = [r for r in rows if r["check"] == "measured"]
    assert [(r["case"], r["gpus"]) for r in measured] == [("ddp", "1"), ("ddp", "2"), ("fsdp", "1"), ("fsdp", "2")]
    work = sm.Workload(SHAPE, 0.1, 1.0, "fp32", cpu_cores=2, log_every=1)  # (a CSV without
    ddp2 = sm.step_time("ddp", 2, work, ic.interconnect_from_fit(FIT))  # log_every: disttrain logged every step)
    assert float(measured[1]["predicted"]) == pytest.approx(ddp2.step_s, rel=1e-9)
    assert float(measured[1]["error"]) == pytest.approx(ddp2.step_s / 0.12 - 1, rel=1e-9)
    published = [r for r in rows if r["check"] == "published"]
    assert len(published) == len(PUBLISHED)
    assert "| yes |" in (tmp_path / "predict.md").read_text()


def test_a_csv_measured_on_another_job_is_refused(tmp_path, capsys):
    (tmp_path / "comm_fit.json").write_text(json.dumps(FIT))
    for column, value, says in (("params", SHAPE.params + 1, "parameters"),
                                ("trained_params", SHAPE.params - 1, "trained parameters (model.freeze)")):
        sizes = {"params": SHAPE.params, "trained_params": SHAPE.params, column: value}
        (tmp_path / "scaling.csv").write_text(f"strategy,world_size,step_time_s,params,trained_params\n"
                                              f"ddp,1,0.1,{sizes['params']},{sizes['trained_params']}\n")
        assert cli(["bench", "predict", "--validate", *TINY, "--measured", str(tmp_path / "scaling.csv"),
                    "--interconnect", f"measured:{tmp_path}", "--out", str(tmp_path / "out")]) == 2
        assert f"was measured on a model of {value} {says}, the model given here has" in capsys.readouterr().err


def test_a_model_that_cannot_be_built_on_meta_leaves_the_size_columns_blank(tmp_path, monkeypatch):
    from disttrain.bench.predict_job import config_sizes

    (tmp_path / "reads_values.py").write_text("import torch\n\ndef build(cfg):\n    torch.ones(()).item()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert config_sizes(ModelConfig(name="reads_values:build")) == {"params": "", "trained_params": ""}
    assert config_sizes(ModelConfig(n_layer=2, d_model=64, n_head=4, seq_len=32)) == {
        "params": SHAPE.params, "trained_params": SHAPE.params}


def test_rows_measured_next_to_busy_neighbours_are_left_out(tmp_path):
    rows = validate(tmp_path, "strategy,world_size,step_time_s,other_cpu\nddp,1,0.1,0.0\nddp,2,0.12,0.05\n"
                              "ddp,2,9.0,0.9\n")
    two = [r for r in rows if r["check"] == "measured" and r["gpus"] == "2"]
    assert float(two[0]["reference"]) == 0.12  # not the median with the 9 s row
    assert "Left out: 1 rows measured while other processes kept more than 0.1 cores busy" in \
        (tmp_path / "predict.md").read_text()


def test_one_sitting_measures_steps_and_links_then_validates(tmp_path):
    """The job's step as it accumulates (4 sequences per rank in micro-batches of 2), measured and predicted."""
    result = run_cli(["bench", "predict", "--measure", "--validate", "--rounds", "1", "--world-sizes", "1,2",
                      "--strategies", "fsdp", "--steps", "2", "--warmup", "1", "--local-batch", "4",
                      "--micro-batch", "2", *TINY,
                      "--max-other-cpu", "4", "--out", str(tmp_path / "s")], tmp_path, timeout=180)  # under pytest
    assert result.returncode == 0, result.stderr
    rows = list(csv.DictReader(open(tmp_path / "s" / "scaling.csv")))
    assert [(r["strategy"], r["world_size"], r["global_batch"], r["micro_batch"]) for r in rows] == [
        ("fsdp", "1", "4", "2"), ("fsdp", "2", "8", "2")]
    assert all(float(r["step_time_s"]) > 0 and r["params"] == str(SHAPE.params) for r in rows)
    fit = json.loads((tmp_path / "s" / "comm" / "comm_fit.json").read_text())
    assert set(fit["collectives"]) == {"all_reduce", "all_gather", "reduce_scatter"}
    assert {tuple(f["sizes_bytes"]) for f in fit["collectives"].values()} == {(2**16, 2**24)}  # the step's sizes
    # timed as a CPU step issues its collectives: each call after as much compute as one pass of an FSDP unit
    phase = 1e3 * float(rows[0]["step_time_s"]) / (2 * (2 + 1) * 2)  # over 2 x (2 blocks + the root) x 2 micro
    assert fit["busy"] == "step" and fit["compute_ms"] == pytest.approx(phase, abs=0.006)
    assert f"each rank computing {fit['compute_ms']:g} ms before each call (--busy step)" in \
        (tmp_path / "s" / "predict.md").read_text()
    checked = [r for r in csv.DictReader(open(tmp_path / "s" / "predict.csv")) if r["check"] == "measured"]
    assert {r["log_every"] for r in rows} == {"10"}  # the default: a median step gathers no figures
    work = sm.Workload(SHAPE, float(rows[0]["step_time_s"]), 1.0, "fp32", micro_steps=2, cpu_cores=2,
                       log_every=0)
    fsdp2 = sm.step_time("fsdp", 2, work, ic.interconnect_from_fit(fit))
    assert float(checked[1]["predicted"]) == pytest.approx(fsdp2.step_s, rel=1e-9)  # from the pooled links


def test_forecast_of_a_tensor_split_prices_its_recorded_calls_and_a_share_of_the_model(tmp_path):
    """parallel.tensor = 2: a group of 2 GPUs reads one batch (the config's global batch over 1 x 2 / 2 = 32
    sequences, micro-batches of 8), each GPU computes half of it on half the parameters, and the calls recorded
    from the config's model (one sequence's, x 8) hold up the compute; a preset's are in closed form."""
    assert cli(["bench", "predict", *TINY, "--set", "parallel.tensor=2", "--set", "dist.nproc=2", "--strategy",
                "ddp,fsdp", "--gpus", "2,8", "--out", str(tmp_path / "gpt")]) == 0
    cfg = load_config(None, [*TINY[1::2], "parallel.tensor=2", "dist.nproc=2"])
    calls = predict_job.tensor_calls_of(cfg, SHAPE, "fp32", 8)
    assert len(calls) > 0 and {c[0] for c in calls} == {"forward", "backward", "step"}
    compute = sm.compute_seconds(SHAPE, 32 * 32 / 2, sm.H100_FP32_TFLOPS, 0.35)
    work = sm.Workload(SHAPE, compute, 32 * 32 / 2, "fp32", 4, tensor=2, tensor_calls=calls)
    rows = list(csv.DictReader(open(tmp_path / "gpt" / "predict.csv")))
    for row in rows:
        expected = sm.step_time(row["strategy"], int(row["gpus"]), work, ic.PRESETS["h100-nvlink+ib-ndr"])
        assert float(row["step_s"]) == pytest.approx(expected.step_s, rel=1e-9)
    assert float(rows[0]["step_s"]) == pytest.approx(float(rows[2]["step_s"]), rel=1e-12)  # (one group, no data)
    text = (tmp_path / "gpt" / "predict.md").read_text()
    assert "32 x 32 tokens per group per step" in text and "- tensor split over 2 GPUs of a node" in text
    assert cli(["bench", "predict", "--model", "llama3-70b", "--set", "parallel.tensor=8", "--set",
                "parallel.sequence_parallel=true", "--gpus", "8,64", "--out", str(tmp_path / "llama")]) == 0
    assert "each micro-batch sends 325 collectives in forward and 322 in backward" in \
        (tmp_path / "llama" / "predict.md").read_text()  # 3 (the loss's) + 1 + 161 + 160; 161 + 160 + 1 (80 blocks)


def test_forecast_of_a_context_split_prices_its_calls_and_a_share_of_the_batch(tmp_path):
    """parallel.context = 2: a group of 2 GPUs reads one batch (32 sequences, micro-batches of 8), each GPU computing
    half of every sequence with the whole model, and each attention's keys and values (x 8 sequences) hold up the
    compute; a preset at `--set model.seq_len=N` takes that sequence length."""
    assert cli(["bench", "predict", *TINY, "--set", "parallel.context=2", "--set", "dist.nproc=2", "--strategy",
                "ddp,fsdp", "--gpus", "2,8", "--out", str(tmp_path / "gpt")]) == 0
    cfg = load_config(None, [*TINY[1::2], "parallel.context=2", "dist.nproc=2"])
    calls = predict_job.context_calls_of(cfg, SHAPE, "fp32", 8)
    assert len(calls) == 4 * 2 and {c[1] for c in calls} == {"all_gather", "reduce_scatter"}
    compute = sm.compute_seconds(SHAPE, 32 * 32 / 2, sm.H100_FP32_TFLOPS, 0.35)
    work = sm.Workload(SHAPE, compute, 32 * 32 / 2, "fp32", 4, context=2, context_calls=calls)
    rows = list(csv.DictReader(open(tmp_path / "gpt" / "predict.csv")))
    for row in rows:
        expected = sm.step_time(row["strategy"], int(row["gpus"]), work, ic.PRESETS["h100-nvlink+ib-ndr"])
        assert float(row["step_s"]) == pytest.approx(expected.step_s, rel=1e-9)
    text = (tmp_path / "gpt" / "predict.md").read_text()
    assert "32 x 32 tokens per group per step" in text and "- context split over 2 GPUs of a node" in text
    assert cli(["bench", "predict", "--model", "llama3-8b", "--set", "parallel.context=8", "--set",
                "model.seq_len=65536", "--gpus", "8", "--out", str(tmp_path / "llama")]) == 0
    text = (tmp_path / "llama" / "predict.md").read_text()
    assert "2 x 65536 tokens per group" in text and "each computing 2 of 16 pieces" in text
    assert "64 collectives in forward and 64 in backward (49,152.0 MiB" in text  # (2 x 65536 x 1024 x (2 + 2 + 4 + 4))


def test_forecast_of_a_tensor_and_context_split_prices_both_splits_calls_on_a_share(tmp_path):
    """parallel.tensor = 2 x parallel.context = 2: a group of 4 GPUs reads one batch; each rank's tensor calls carry
    its share of a sequence (1/2 the tensor split's alone), its context calls its heads' keys (1/2 the context
    split's alone)."""
    settings = ["parallel.tensor=2", "parallel.context=2", "dist.nproc=4"]
    assert cli(["bench", "predict", *TINY, *(x for o in settings for x in ("--set", o)), "--strategy", "fsdp",
                "--gpus", "4,16", "--out", str(tmp_path / "gpt")]) == 0
    cfg = load_config(None, [*TINY[1::2], *settings])
    alone = [load_config(None, [*TINY[1::2], o, "dist.nproc=2"]) for o in settings[:2]]
    tensor, context = predict_job.tensor_calls_of(cfg, SHAPE, "fp32", 8), predict_job.context_calls_of(cfg, SHAPE,
                                                                                                         "fp32", 8)
    assert [c[2] for c in tensor if c[0] != "step"] == [c[2] / 2 for c in predict_job.tensor_calls_of(
        alone[0], SHAPE, "fp32", 8) if c[0] != "step"]
    assert [c[2] for c in context] == [c[2] / 2 for c in predict_job.context_calls_of(alone[1], SHAPE, "fp32", 8)]
    compute = sm.compute_seconds(SHAPE, 32 * 32 / 4, sm.H100_FP32_TFLOPS, 0.35)
    work = sm.Workload(SHAPE, compute, 32 * 32 / 4, "fp32", 4, tensor=2, context=2, tensor_calls=tensor,
                       context_calls=context)
    for row in csv.DictReader(open(tmp_path / "gpt" / "predict.csv")):
        expected = sm.step_time("fsdp", int(row["gpus"]), work, ic.PRESETS["h100-nvlink+ib-ndr"])
        assert float(row["step_s"]) == pytest.approx(expected.step_s, rel=1e-9)


def test_forecast_of_a_pipeline_of_context_splits_prices_each_stage_s_calls_and_a_share_of_the_stream(tmp_path):
    """parallel.pipeline = 2 x parallel.context = 2 on the Llama 3 8B preset: a group of 4 GPUs reads one batch, each
    stage's ranks sending their blocks' context calls (16 of 32 blocks' each) and half of the stream between stages
    (their pieces of each sequence); each row is the model's step of that workload, slower than the pipeline with
    its context calls free. At 4 GPUs, one group, the context ranks are the stages' data axis: the stream is in bf16
    there too (FSDP2's gathered copies), as at 8 and 64."""
    common = ["--model", "llama3-8b", "--set", "parallel.precision=bf16-mixed", "--local-batch", "4",
              "--micro-batch", "1", "--strategy", "fsdp", "--gpus", "4,8,64"]
    assert cli(["bench", "predict", *common, "--set", "parallel.pipeline=2", "--set", "parallel.context=2",
                "--out", str(tmp_path / "ppcp")]) == 0
    cfg = load_config(None, ["model.name=llama3-8b", "parallel.precision=bf16-mixed", "parallel.pipeline=2",
                             "parallel.context=2"])
    alone = load_config(None, ["model.name=llama3-8b", "parallel.precision=bf16-mixed", "parallel.pipeline=2"])
    shape = MODELS["llama3-8b"]
    split = predict_job.pipeline_stages(cfg, shape, "bf16-mixed", True)
    assert split.send_bytes == predict_job.pipeline_stages(alone, shape, "bf16-mixed", True).send_bytes / 2
    calls = predict_job.context_calls_of(cfg, shape, "bf16-mixed", 1)
    compute = sm.compute_seconds(shape, 4 * shape.seq_len / 4, sm.H100_BF16_TFLOPS, 0.35)
    work = sm.Workload(shape, compute, 4 * shape.seq_len / 4, "bf16-mixed", 4, pipeline=2, context=2,
                       stages=split.stages, send_bytes=split.send_bytes, context_calls=calls)
    assert [len(model_split.stage_context_calls(work, stage)) for stage in split.stages] == [4 * 16, 4 * 16]
    net = ic.PRESETS["h100-nvlink+ib-ndr"]
    rows = list(csv.DictReader(open(tmp_path / "ppcp" / "predict.csv")))
    assert cli(["bench", "predict", *common[:-1], "4", "--set", "parallel.pipeline=2", "--set", "parallel.context=2",
                "--out", str(tmp_path / "one")]) == 0  # (one group the only count)
    rows += list(csv.DictReader(open(tmp_path / "one" / "predict.csv")))
    assert [int(row["gpus"]) for row in rows] == [4, 8, 64, 4]
    for row in rows:
        expected = sm.step_time("fsdp", int(row["gpus"]), work, net)
        assert float(row["step_s"]) == pytest.approx(expected.step_s, rel=1e-9)
        assert expected.step_s > sm.step_time("fsdp", int(row["gpus"]), replace(work, context_calls=()), net).step_s
    text = (tmp_path / "ppcp" / "predict.md").read_text()
    assert "(tokens per GPU: 1/4 of them), in 4 micro-batches" in text
    assert "each micro-batch sends 32 collectives in forward and 32 in backward" in text
    assert "the busiest pipeline rank" in text and "the strategy runs over every GPU of a stage" in text
    assert cli(["bench", "predict", *common, "--set", "parallel.pipeline=2", "--set", "parallel.context=2", "--set",
                "parallel.pipeline_schedule=interleaved-1f1b", "--out", str(tmp_path / "looped")]) == 0
    text = (tmp_path / "looped" / "predict.md").read_text()  # (2 stages a rank, 8 blocks each: a rank's 16 blocks)
    assert "each micro-batch sends 32 collectives in forward and 32 in backward" in text


def test_a_sweep_of_the_splits_forecasts_each_degree_as_on_its_own(tmp_path):
    """--sweep parallel.tensor=1,2 (and pipeline): one table, each value's rows those of a forecast with --set; a
    group's batch kept, each GPU's compute its share of the FLOPs."""
    for key, values in (("parallel.tensor", "1,2"), ("parallel.pipeline", "1,2")):
        assert cli(["bench", "predict", "--model", "llama3-8b", "--sweep", f"{key}={values}", "--local-batch", "4",
                    "--micro-batch", "1", "--gpus", "8,64", "--out", str(tmp_path / key)]) == 0
        swept = [r for r in csv.DictReader(open(tmp_path / key / "predict.csv")) if r["setting"] == f"{key}=2"]
        assert cli(["bench", "predict", "--model", "llama3-8b", "--set", f"{key}=2", "--local-batch", "4",
                    "--micro-batch", "1", "--gpus", "8,64", "--out", str(tmp_path / f"{key}-alone")]) == 0
        alone = list(csv.DictReader(open(tmp_path / f"{key}-alone" / "predict.csv")))
        assert [(r["gpus"], r["step_s"], r["tokens_per_s_per_gpu"]) for r in swept] == [
            (r["gpus"], r["step_s"], r["tokens_per_s_per_gpu"]) for r in alone]


def test_forecast_of_a_pipeline_splits_a_preset_as_disttrain_would(tmp_path):
    """Llama 3 70B over 4 pipeline ranks (interleaved: 8 stages) in 16 micro-batches of one sequence: a GPU computes
    a quarter of the group's batch; the stages are disttrain's balanced split of the 80 blocks."""
    assert cli(["bench", "predict", "--model", "llama3-70b", "--set", "parallel.pipeline=4", "--set",
                "parallel.pipeline_schedule=interleaved-1f1b", "--local-batch", "16", "--micro-batch", "1", "--gpus",
                "32,64", "--out", str(tmp_path)]) == 0
    cfg = load_config(None, ["parallel.pipeline=4", "parallel.pipeline_schedule=interleaved-1f1b"])
    stages, send, tied = predict_job.pipeline_stages(cfg, MODELS["llama3-70b"], "bf16-mixed", data_axis=True)
    held = [[stages[s].n_layer for s in (r, r + 4)] for r in range(4)]  # (stage s on rank s mod 4)
    assert [sum(h) for h in held] == [16, 22, 22, 20] and send == 8192 * 8192 * 2 and tied == 0
    assert predict_job.pipeline_stages(cfg, MODELS["llama3-70b"], "bf16-mixed").send_bytes == 8192 * 8192 * 4
    tokens = 16 * 8192 / 4
    work = sm.Workload(MODELS["llama3-70b"], sm.compute_seconds(MODELS["llama3-70b"], tokens, 989, 0.35), tokens,
                       "bf16-mixed", 16, pipeline=4, schedule="interleaved-1f1b", stages=stages, send_bytes=send,
                       orders=predict_job.pipeline_orders(cfg, 16))
    rows = list(csv.DictReader(open(tmp_path / "predict.csv")))
    for row in rows:
        expected = sm.step_time("fsdp", int(row["gpus"]), work, ic.PRESETS["h100-nvlink+ib-ndr"])
        assert float(row["step_s"]) == pytest.approx(expected.step_s, rel=1e-9)
    report = (tmp_path / "predict.md").read_text()
    assert "- pipeline of 4 ranks (parallel.pipeline, interleaved-1f1b, 2 stages a rank)" in report


def test_forecast_of_a_pipeline_of_tensor_splits_prices_each_rank_s_stages_calls(tmp_path):
    """Llama 3 405B as Meta trained it (tensor 8 within a node, 16 pipeline ranks, interleaved; 32 micro-batches of
    one sequence a group): each pipeline rank's calls are those of its stages in closed form beside a data axis;
    and a config's GPT over 2 x 2 (its stages' calls recorded) forecasts too."""
    settings = ["parallel.tensor=8", "parallel.pipeline=16", "parallel.pipeline_schedule=interleaved-1f1b",
                "parallel.sequence_parallel=true"]
    assert cli(["bench", "predict", "--model", "llama3-405b", *(a for s in settings for a in ("--set", s)),
                "--local-batch", "32", "--micro-batch", "1", "--gpus", "8192", "--out", str(tmp_path)]) == 0
    model, cfg = MODELS["llama3-405b"], load_config(None, settings)
    split = predict_job.pipeline_stages(cfg, model, "bf16-mixed", data_axis=True)
    calls = predict_job.stage_calls_of(cfg, model, "bf16-mixed", 1, True)
    assert split.send_bytes == 8192 * 16384 * 2 / 8  # (a tensor rank's share of the sequence)
    assert [sum(c[1] == "all_gather" and c[2] == 8192 * 128256 * 2 for c in stage)
            for stage in calls.stages] == [0] * 31 + [1]  # (the logits, whole, on the last stage)
    assert all(c[3] == "bfloat16" for stage in calls.stages for c in stage if c[2] > 8192 * 4)
    assert len(calls.steps) == 16 and all(c[0] == "step" and c[3] == "float32" for r in calls.steps for c in r)
    tokens = 32 * 8192 / 128
    work = sm.Workload(model, sm.compute_seconds(model, tokens, 989, 0.35), tokens, "bf16-mixed", 32, tensor=8,
                       pipeline=16, schedule="interleaved-1f1b", stages=split.stages, send_bytes=split.send_bytes,
                       stage_calls=calls.stages, step_calls=calls.steps, orders=predict_job.pipeline_orders(cfg, 32))
    row = next(csv.DictReader(open(tmp_path / "predict.csv")))
    assert float(row["step_s"]) == pytest.approx(sm.step_time("fsdp", 8192, work, ic.PRESETS[
        "h100-nvlink+ib-ndr"]).step_s, rel=1e-9)
    deeper = tmp_path / "deeper"  # (Meta's 126 blocks allow up to 7 stages a rank over 16)
    assert cli(["bench", "predict", "--model", "llama3-405b", *(a for s in settings for a in ("--set", s)),
                "--sweep", "parallel.pipeline_stages_per_rank=2,7", "--local-batch", "32", "--micro-batch", "1",
                "--gpus", "8192", "--out", str(deeper)]) == 0
    two, seven = (float(r["step_s"]) for r in csv.DictReader(open(deeper / "predict.csv")))
    seventh = tmp_path / "seventh"
    assert cli(["bench", "predict", "--model", "llama3-405b", *(a for s in settings for a in ("--set", s)),
                "--set", "parallel.pipeline_stages_per_rank=7", "--local-batch", "32", "--micro-batch", "1",
                "--gpus", "8192", "--out", str(seventh)]) == 0
    assert "its stages between the ends hold 1 to 2 blocks" in (seventh / "predict.md").read_text()  # (126 in 112)
    assert "between the ends" not in (tmp_path / "predict.md").read_text()  # (4 blocks each, 32 stages)
    assert two == pytest.approx(float(row["step_s"]), rel=1e-9) and seven < two  # (the bubble: test_scale_model)
    assert cli(["bench", "predict", "--set", "parallel.pipeline=2", "--set", "parallel.tensor=2", "--set",
                "dist.nproc=4", "--set", "model.n_head=2", "--gpus", "8,16", "--out", str(tmp_path / "gpt")]) == 0
    report = (tmp_path / "gpt" / "predict.md").read_text()
    assert "- tensor split over 2 GPUs" in report and "- pipeline of 2 ranks" in report


@pytest.mark.parametrize("split", ["tensor", "context"])
def test_a_sitting_of_a_split_times_one_rank_s_compute_alone(tmp_path, split):
    """--measure at 1 rank of a tensor or context split of 2: the whole group's job on a fake group of 2, whose
    collectives return at once (the base the model predicts the 2-rank step from; a context split's last rank);
    --local-batch is the group's at every world size; the comm fit's compute phase is the step over a
    micro-batch's split calls."""
    strategy = "ddp" if split == "tensor" else "fsdp"
    result = run_cli(["bench", "predict", "--measure", "--validate", "--rounds", "1", "--world-sizes", "1,2",
                      "--strategies", strategy, "--steps", "2", "--warmup", "1", "--local-batch", "4", *TINY,
                      "--set", f"parallel.{split}=2", "--max-other-cpu", "4", "--out", str(tmp_path / "s")], tmp_path,
                     timeout=180)
    assert result.returncode == 0, result.stderr
    rows = list(csv.DictReader(open(tmp_path / "s" / "scaling.csv")))
    assert [(r["world_size"], r[split], r["global_batch"]) for r in rows] == [("1", "2", "4"), ("2", "2", "4")]
    fit = json.loads((tmp_path / "s" / "comm" / "comm_fit.json").read_text())
    cfg = load_config(None, [*TINY[1::2], f"parallel.{split}=2"])
    calls = (predict_job.tensor_calls_of if split == "tensor" else predict_job.context_calls_of)(cfg, SHAPE, "fp32", 4)
    micro = sum(1 for c in calls if c[0] != "step")  # each call after a phase of compute as long as the step's gaps
    assert fit["compute_ms"] == pytest.approx(1e3 * float(rows[0]["step_time_s"]) / micro, abs=0.006)
    checked = [r for r in csv.DictReader(open(tmp_path / "s" / "predict.csv")) if r["check"] == "measured"]
    work = sm.Workload(SHAPE, float(rows[0]["step_time_s"]), 1.0, "fp32", cpu_cores=2, log_every=0,
                       **{split: 2, f"{split}_calls": calls})
    expected = sm.step_time(strategy, 2, work, ic.interconnect_from_fit(fit))
    assert float(checked[1]["predicted"]) == pytest.approx(expected.step_s, rel=1e-9)


def test_a_sitting_of_a_pipeline_predicts_its_stages_from_the_whole_model_on_one_rank(tmp_path):
    """--measure at 1 rank of a pipeline of 2: the whole model, its 2 micro-batches accumulated (the compute the
    stages share); at 2 ranks the 1f1b pipeline; predicted from disttrain's own split of the counted model."""
    result = run_cli(["bench", "predict", "--measure", "--validate", "--rounds", "1", "--world-sizes", "1,2",
                      "--strategies", "ddp", "--steps", "2", "--warmup", "1", "--local-batch", "4", "--micro-batch",
                      "2", *TINY, "--set", "parallel.pipeline=2", "--max-other-cpu", "4", "--out",
                      str(tmp_path / "s")], tmp_path, timeout=180)
    assert result.returncode == 0, result.stderr
    rows = list(csv.DictReader(open(tmp_path / "s" / "scaling.csv")))
    assert [(r["world_size"], r["pipeline"], r["global_batch"], r["micro_batch"]) for r in rows] == [
        ("1", "2", "4", "2"), ("2", "2", "4", "2")]
    fit = json.loads((tmp_path / "s" / "comm" / "comm_fit.json").read_text())
    assert fit["compute_ms"] == pytest.approx(1e3 * float(rows[0]["step_time_s"]) / (2 * 2 * 2), abs=0.006)
    cfg = load_config(None, [*TINY[1::2], "parallel.pipeline=2", "dist.nproc=2"])
    stages, send, tied = predict_job.pipeline_stages(cfg, SHAPE, "fp32")
    assert tied == 256 * 64 * 4  # (the tied embedding and head: their gradients summed between the ends)
    assert sum(s.params for s in stages) == SHAPE.params + 256 * 64  # (the tied head: the last stage holds it too)
    assert sum(s.flops_per_token() for s in stages) == pytest.approx(SHAPE.flops_per_token(), rel=1e-12)
    work = sm.Workload(SHAPE, float(rows[0]["step_time_s"]) / 2, 1.0, "fp32", 2, cpu_cores=2, log_every=0,
                       pipeline=2, stages=stages, send_bytes=send * 2, tied_bytes=tied)
    checked = [r for r in csv.DictReader(open(tmp_path / "s" / "predict.csv")) if r["check"] == "measured"]
    expected = sm.step_time("ddp", 2, work, ic.interconnect_from_fit(fit))
    assert float(checked[1]["predicted"]) == pytest.approx(expected.step_s, rel=1e-9)


def test_rounds_of_comm_runs_pool_their_calls():
    def raw(times, other):
        return {"world_size": 2, "other_cpu": other, "date": str(other),
                "rows": [{"collective": "all_gather", "bytes": b, "iterations": len(times), "times_s": times,
                          "cpu_s": [t / 10 for t in times]} for b in (1024, 4096)]}

    pooled = predict_measure.pool([raw([1.0, 2.0], 0.1), raw([3.0], 0.3)])
    assert [(r["bytes"], r["iterations"], r["times_s"], r["cpu_s"]) for r in pooled["rows"]] == [
        (b, 3, [1.0, 2.0, 3.0], [0.1, 0.2, 0.3]) for b in (1024, 4096)]
    assert pooled["other_cpu"] == 0.3 and pooled["date"] == "0.3"  # the busiest neighbours, the last date
    older = raw([3.0], 0.3)
    del older["rows"][0]["cpu_s"]  # a run without CPU times: the pooled size has none
    assert "cpu_s" not in predict_measure.pool([raw([1.0], 0.1), older])["rows"][0]
    half = {**raw([5.0], 0.1), "rows": [{**r, "dtype": "bfloat16"} for r in raw([5.0], 0.1)["rows"]]}
    both = [{**raw([1.0], 0.1), "rows": raw([1.0], 0.1)["rows"] + half["rows"]},
            {**raw([2.0], 0.1), "rows": raw([2.0], 0.1)["rows"] + half["rows"]}]
    assert [(r.get("dtype", "float32"), r["bytes"], r["times_s"]) for r in predict_measure.pool(both)["rows"]] == [
        ("float32", 1024, [1.0, 2.0]), ("float32", 4096, [1.0, 2.0]),  # each dtype's calls pooled apart
        ("bfloat16", 1024, [5.0, 5.0]), ("bfloat16", 4096, [5.0, 5.0])]


@pytest.mark.parametrize("local, micro, model, batch", [
    (0, 0, "", (8, 8)), (32, 0, "", (32, 32)), (0, 4, "", (4, 4)), (8, 4, "", (8, 4)), (0, 0, "llama3-8b", (2, 2))])
def test_measure_times_one_micro_batch_unless_the_batch_per_rank_is_given_with_one(local, micro, model, batch):
    """`--measure`'s batch per rank: --local-batch alone is one micro-batch, as a forecast reads it (the config's
    data.micro_batch_size, 8, only where neither is given)."""
    args = argparse.Namespace(local_batch=local, micro_batch=micro, model=model)
    assert predict.measure_batch(args, load_config(None, [])) == batch


def test_the_sitting_s_compute_phase_is_one_unit_pass_of_one_micro_batch():
    def row(step, global_batch, micro):
        return {"strategy": "fsdp", "world_size": "1", "step_time_s": str(step), "global_batch": str(global_batch),
                "micro_batch": str(micro)}
    assert predict_measure.phase_ms([row(0.12, 4, 4)], 2) == pytest.approx(1e3 * 0.12 / (2 * 3), rel=1e-12)
    assert predict_measure.phase_ms([row(0.24, 8, 4)], 2) == pytest.approx(1e3 * 0.12 / (2 * 3), rel=1e-12)
    assert predict_measure.phase_ms([], 2) == 8.0


@pytest.mark.parametrize("precision, compression, sent", [
    ("fp32", "none", ["float32"]), ("bf16-mixed", "none", ["float32", "bfloat16"]),
    ("fp16-mixed", "bf16", ["float32", "float16", "bfloat16"]), ("fp32", "fp16", ["float32", "float16"]),
    ("bf16-true", "fp16", ["float32", "bfloat16", "float16"])])
def test_a_sitting_measures_the_links_of_each_element_type_the_job_sends(precision, compression, sent):
    assert predict_job.wire_dtypes(precision, compression) == sent


@pytest.mark.parametrize("args, message", [
    (["--strategy", "tp"], "--strategy 'tp' is not modelled; choose from ddp, zero1, zero2, fsdp, hsdp"),
    (["--interconnect", "infiniband"], "--interconnect 'infiniband' is not known; choose from h100-nvlink+ib-ndr"),
    (["--interconnect", "measured:/nonexistent"], "--interconnect measured:/nonexistent: cannot read a comm_fit.json"),
    (["--gpus", "8,sixty-four"], "--gpus '8,sixty-four': give counts >= 1 separated by commas"),
    (["--gpus", "0,8"], "--gpus '0,8': give counts >= 1"),
    (["--model", "gpt5"], "--model 'gpt5' is not a preset"),
    (["--model", "resnet50"], "the FLOPs of resnet50 are not modelled; give --compute-s"),
    (["--model", "llama3-8b", "--strategy", "ddp", "--set", "parallel.grad_compression=powersgd"],
     "parallel.grad_compression = 'powersgd': the shapes of llama3-8b's gradients are not known"),
    (["--strategy", "ddp,fsdp", "--set", "parallel.grad_compression=powersgd"],
     "parallel.grad_compression = 'powersgd' is a DDP communication hook: fsdp does not run it"),
    (["--measure", "--strategies", "fsdp", "--set", "parallel.grad_compression=powersgd"], "--strategies fsdp at 1 "
     "rank: parallel.grad_compression = 'powersgd' is a DDP communication hook"),  # (--measure models nothing)
    (["--strategy", "ddp", "--set", "parallel.bucket_cap_mb=0"], "parallel.bucket_cap_mb = 0.0: must be > 0"),
    (["--set", "parallel.strategy=single"], "parallel.strategy = 'single' is not modelled; give --strategy"),
    (["--set", "parallel.strategy=fsdpp"], "parallel.strategy = 'fsdpp' is not known"),
    (["--set", "parallel.context=2"], "parallel.tensor x parallel.pipeline x parallel.context = 2 does not divide "
     "dist.nproc = 1"),
    (["--model", "bert-large", "--set", "parallel.context=2", "--gpus", "8"], "parallel.context = 2: bert-large has "
     "no attention the model knows of"),
    (["--model", "llama3-8b", "--set", "parallel.context=16", "--gpus", "16"], "parallel.context = 16: its groups "
     "would straddle nodes of 8 devices"),
    (["--model", "llama3-8b", "--strategy", "hsdp", "--set", "parallel.context=2", "--gpus", "16"], "hsdp with "
     "parallel.context = 2 is not modelled"),
    (["--set", "parallel.tensor=3"], "parallel.tensor x parallel.pipeline x parallel.context = 3 does not divide "
     "dist.nproc = 1 ranks"),
    (["--set", "parallel.pipeline=2"], "parallel.tensor x parallel.pipeline x parallel.context = 2 does not divide "
     "dist.nproc = 1"),
    (["--set", "parallel.pipeline=2", "--set", "dist.nproc=2", "--set", "parallel.pipeline_schedule=dualpipev",
      "--set", "data.micro_batch_size=16"], "parallel.pipeline_schedule = 'dualpipev' runs at least 2 x "
     "parallel.pipeline = 4 micro-batches a step, not 2"),
    (["--set", "parallel.pipeline=2", "--set", "dist.nproc=2", "--set", "parallel.pipeline_stages_per_rank=3"],
     "parallel.pipeline_stages_per_rank = 3: parallel.pipeline_schedule = '1f1b' runs 1 a rank"),
    (["--set", "parallel.tensor=3", "--set", "dist.nproc=3"], "parallel.tensor = 3 does not divide the model's "
     "attention heads (4)"),
    (["--model", "resnet50", "--set", "parallel.tensor=2", "--compute-s", "1"], "parallel.tensor = 2: resnet50 has "
     "no tensor-parallel plan"),
    (["--model", "llama3-8b", "--set", "parallel.tensor=16", "--gpus", "16"], "parallel.tensor = 16: its groups "
     "would straddle nodes of 8 devices"),
    (["--model", "llama3-8b", "--set", "parallel.tensor=2", "--gpus", "1,8"], "--gpus 1: a group of "
     "parallel.tensor x parallel.pipeline x parallel.context = 2 GPUs reads one batch; give multiples of 2"),
    (["--model", "llama3-8b", "--set", "parallel.tensor=3", "--gpus", "24"], "parallel.tensor = 3: its groups would "
     "straddle nodes of 8 devices"),
    (["--model", "llama3-8b", "--strategy", "zero1", "--set", "parallel.tensor=2", "--gpus", "16"], "zero1 with "
     "parallel.tensor = 2 does not run in disttrain (zero1 has no data axes)"),
    (["--model", "llama3-8b", "--strategy", "ddp", "--set", "parallel.tensor=2", "--set",
      "parallel.grad_compression=powersgd", "--gpus", "16"], "parallel.grad_compression = 'powersgd' with "
     "parallel.tensor = 2 does not run in disttrain"),
    (["--measure", "--set", "parallel.tensor=2", "--set", "model.n_head=2"], "--world-sizes 1,2,3: 3 ranks do not "
     "hold whole groups of parallel.tensor x parallel.pipeline x parallel.context = 2; give 1 and multiples of 2"),
    (["--measure", "--set", "parallel.pipeline=2"], "--world-sizes 1,2,3: 3 ranks do not hold whole groups of "
     "parallel.tensor x parallel.pipeline x parallel.context = 2"),
    (["--model", "llama3-8b", "--sweep", "parallel.tensor=1,2", "--compute-s", "3"], "--sweep parallel.tensor: each "
     "value's compute is a GPU's share of the FLOPs, which a given --compute-s (one split's) does not say"),
    (["--model", "llama3-8b", "--set", "parallel.pipeline=2", "--set", "parallel.pipeline_split=layers.4"],
     "parallel.pipeline_split = 'layers.4': llama3-8b has no module names to split at"),
    (["--model", "resnet50", "--set", "parallel.pipeline=2", "--compute-s", "1"], "the model's 0 blocks cannot fill "
     "2 pipeline stages"),
    (["--validate", "--measured", "pp2.csv", "--interconnect", "measured:fit.json"], "--measured pp2.csv was "
     "measured with parallel.pipeline = 2, the job given here has 1"),
    (["--validate", "--measured", "tp0.csv", "--interconnect", "measured:fit.json"], "--measured tp0.csv, line 2: "
     "expected a world_size >= 1"),
    (["--validate", "--measured", "tp2.csv", "--interconnect", "measured:fit.json"], "--measured tp2.csv was "
     "measured with parallel.tensor = 2, the job given here has 1: pass the same CONFIG / --set as the measurement "
     "(--set parallel.tensor=2)"),
    (["--model", "llama3-8b", "--strategy", "hsdp", "--set", "parallel.tensor=2", "--gpus", "16"], "hsdp with "
     "parallel.tensor = 2 is not modelled"),
    (["--set", "parallel.strategy=hsdp", "--set", "parallel.hsdp_shard_size=2", "--set",
      "parallel.reshard_after_forward=false"],
     "parallel.reshard_after_forward = false with hsdp is not modelled"),
    (["--set", "model.name=no_such_module:build"], "model.name = 'no_such_module:build': cannot import"),
    (["--set", "model.name=needs_real_tensors:build"], "model.name = 'needs_real_tensors:build': the model cannot be "
     "built on the meta device to count it (RuntimeError"),
    (["--validate", "--measured", "x.csv"], "--validate --measured needs --interconnect measured:"),
    (["--measure", "--world-sizes", "1,two"], "--world-sizes '1,two': give counts"),
    (["--measure", "--world-sizes", "1,100000"], "--world-sizes: 100000 ranks is more than this machine can start"),
    (["--measure", "--validate", "--rounds", "0"], "--rounds 0: give 1 or more"),
    (["--sweep", "model.d_model=128,256"], "--sweep model.d_model: a forecast sweeps a setting that changes only a "
     "step's collectives (parallel.grad_compression, parallel.powersgd_rank"),
    (["--sweep", "parallel.grad_compression=zip"], "parallel.grad_compression"),
    (["--sweep", "parallel.bucket_cap_mb"], "--sweep parallel.bucket_cap_mb: expected section.key=v1,v2"),
    (["--validate", "--sweep", "parallel.bucket_cap_mb=1,25"], "--sweep parallel.bucket_cap_mb=1,25: a forecast's"),
    (["--strategy", "hsdp", "--set", "parallel.hsdp_shard_size=-2"], "parallel.hsdp_shard_size = -2: must be >= 0"),
    (["--strategy", "fsdp", "--sweep", "parallel.bucket_cap_mb=1,25"], "--sweep parallel.bucket_cap_mb: fsdp does "
     "not read it; give --strategy with one that does"),
    (["--sweep", "parallel.strategy=ddp,fsdp"], "--sweep parallel.strategy: a forecast sweeps a setting"),
    (["--strategy", "hsdp", "--gpus", "8,12", "--sweep", "parallel.fsdp_prefetch=0,2"], "--gpus 12: hsdp shards "
     "within a node of 8 devices"),  # (the same refusal at every value: not the sweep's)
    (["--strategy", "fsdp", "--sweep", "parallel.grad_compression=powersgd"], "parallel.grad_compression = "
     "'powersgd' is a DDP communication hook: fsdp does not run it"),  # (every value's refusal: as without a sweep)
    (["--strategy", "hsdp", "--gpus", "24", "--sweep", "parallel.hsdp_shard_size=16,6"], "--sweep "
     "parallel.hsdp_shard_size=16,6: no strategy runs any of its values: hsdp with parallel.hsdp_shard_size=16"),
    (["--measure", "--local-batch", "6", "--micro-batch", "4"], "--local-batch 6: --measure accumulates it in "
     "micro-batches of --micro-batch 4; give a multiple of it"),
    (["--measure", "--set", "parallel.bucket_cap_mb=1"], "--strategies fsdp at 1 rank: parallel.bucket_cap_mb = 1.0 "
     "needs a strategy that uses it (ddp, zero1), not 'fsdp'"),
    (["--validate", "--measured", "busy.csv", "--interconnect", "measured:fit.json"], "--measured busy.csv: every row "
     "was measured while other processes kept more than 0.1 cores busy"),
    (["--strategy", ","], "--strategy ',' names no strategy"),
    (["--micro-batch", "5"], "--micro-batch 5: the batch per GPU, 32 (the config's: data.global_batch_size 32 over "
     "dist.nproc 1, one node's ranks), is not a multiple of it"),
    (["--interconnect", "measured:fit.json"], "--interconnect measured:...: give --compute-s, one device's step of 32 "
     "sequences in micro-batches of 8: the 1-rank step_time_s of `disttrain bench predict [CONFIG] --measure "
     "--world-sizes 1 --local-batch 32 --micro-batch 8`"),
    (["--set", "data.global_batch_size=36"], "data.global_batch_size = 36 is not a positive multiple of "
     "data.micro_batch_size x dist.nproc = 8 x 1"),
    (["--nodes", "0"], "--nodes 0: give nodes >= 1"),
    (["--nodes", "3"], "data.global_batch_size = 32 is not a positive multiple of data.micro_batch_size x "
     "dist.nproc x --nodes = 8 x 1 x 3"),
    (["--mfu", "0"], "--mfu 0: give a fraction in (0, 1]"),
    (["--mfu", "1.5"], "--mfu 1.5: give a fraction in (0, 1]"),
    (["--tflops", "nan"], "--tflops nan: give a peak > 0"),
    (["--compute-s", "-1"], "--compute-s -1: give seconds >= 0"),
    (["--gpus-per-node", "-1"], "--gpus-per-node -1: give devices >= 0"),
    (["--measure", "--steps", "0"], "--steps 0: give steps >= 1"),
    (["--measure", "--validate", "--interconnect", "measured:fit.json"], "--interconnect measured:fit.json: --measure "
     "--validate measures this machine's links itself"),
    (["--interconnect", "measured:list.json"], "--interconnect measured:list.json: cannot read a comm_fit.json"),
    (["--interconnect", "measured:one.json"], "measured:one.json: world_size 1: a fit of links needs 2 or more ranks"),
    (["--validate", "--measured", "text.csv", "--interconnect", "measured:fit.json"], "--measured text.csv, line 2: "
     "expected a world_size >= 1, a step_time_s > 0"),
    (["--validate", "--measured", "tp.csv", "--interconnect", "measured:fit.json"], "--measured tp.csv: no row of a "
     "modelled strategy"),
    (["--validate", "--measured", "two.csv", "--interconnect", "measured:fit.json"], "--measured two.csv: no series "
     "could be predicted (ddp: no 1-rank row)"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "needs_real_tensors.py").write_text(  # a factory that reads a value: nothing to read on meta
        "import torch\n\ndef build(cfg):\n    torch.nn.Linear(int(torch.ones(()).item()), 2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "fit.json").write_text(json.dumps(FIT))
    (tmp_path / "busy.csv").write_text("strategy,world_size,step_time_s,other_cpu\nddp,1,0.1,0.5\n")
    (tmp_path / "text.csv").write_text("strategy,world_size,step_time_s\nddp,1,fast\n")
    (tmp_path / "tp.csv").write_text("strategy,world_size,step_time_s\ntp,1,0.1\n")
    (tmp_path / "two.csv").write_text("strategy,world_size,step_time_s\nddp,2,0.1\n")
    (tmp_path / "pp2.csv").write_text("strategy,world_size,step_time_s,pipeline\nddp,1,0.1,2\nddp,2,0.1,2\n")
    (tmp_path / "tp0.csv").write_text("strategy,world_size,step_time_s,tensor\nddp,1,0.1,0\n")
    (tmp_path / "tp2.csv").write_text("strategy,world_size,step_time_s,tensor\nddp,1,0.1,2\nddp,2,0.1,2\n")
    (tmp_path / "list.json").write_text(json.dumps({**FIT, "collectives": []}))
    (tmp_path / "one.json").write_text(json.dumps({**FIT, "world_size": 1}))
    assert cli(["bench", "predict", *args, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("disttrain: error: " + message) and "\n" not in err, err
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_validate_reads_the_series_of_a_bench_scaling_csv(tmp_path):
    (tmp_path / "comm_fit.json").write_text(json.dumps(FIT))
    (tmp_path / "scaling.csv").write_text(
        "strategy,loop,mode,world_size,sweep_key,sweep_value,global_batch,micro_batch,log_every,step_time_s\n"
        "ddp,disttrain,weak,1,,,24,4,1,0.12\nddp,hand-written,weak,1,,,24,4,0,0.12\nddp,disttrain,weak,2,,,48,4,1,0.2\n"
        "ddp,hand-written,weak,2,,,48,4,0,0.19\nfsdp,disttrain,strong,2,,,24,4,10,0.1\n"
        "ddp,disttrain,weak,1,parallel.bucket_cap_mb,0.01,24,4,1,0.12\n"
        "ddp,disttrain,weak,2,parallel.bucket_cap_mb,0.01,48,4,1,0.2\n"
        "ddp,disttrain,weak,1,parallel.grad_compression,powersgd,24,4,1,0.12\n"
        "ddp,disttrain,weak,2,parallel.grad_compression,powersgd,48,4,1,0.2\n"
        "ddp,disttrain,weak,1,model.d_model,128,24,4,1,0.12\n"
        "ddp,disttrain,weak,2,model.d_model,128,48,4,1,0.2\n")
    assert cli(["bench", "predict", "--validate", *TINY, "--measured", str(tmp_path / "scaling.csv"),
                "--interconnect", f"measured:{tmp_path}", "--cpu-cores", "2", "--out", str(tmp_path)]) == 0
    rows = [r for r in csv.DictReader(open(tmp_path / "predict.csv")) if r["check"] == "measured"]
    assert [(r["case"], r["gpus"]) for r in rows[:4]] == [("ddp weak disttrain", "1"), ("ddp weak disttrain", "2"),
                                                      ("ddp weak hand-written", "1"), ("ddp weak hand-written", "2")]
    work = sm.Workload(SHAPE, 0.12, 1.0, "fp32", micro_steps=6, cpu_cores=2, log_every=1)
    net = ic.interconnect_from_fit(FIT)
    assert float(rows[1]["predicted"]) == pytest.approx(sm.step_time("ddp", 2, work, net).step_s,
                                                        rel=1e-9)  # 24 per rank in micro-batches of 4
    assert float(rows[3]["predicted"]) == pytest.approx(  # the hand-written loop gathers no figures per step
        sm.step_time("ddp", 2, replace(work, log_every=0), net).step_s, rel=1e-9)
    assert float(rows[3]["predicted"]) < float(rows[1]["predicted"])
    assert [(r["case"], r["gpus"]) for r in rows[4:6]] == [("ddp weak disttrain parallel.bucket_cap_mb 0.01", "1"),
                                                           ("ddp weak disttrain parallel.bucket_cap_mb 0.01", "2")]
    swept = sm.step_time("ddp", 2, replace(work, bucket_bytes=0.01 * 2**20), net).step_s  # each series its buckets
    assert float(rows[5]["predicted"]) == pytest.approx(swept, rel=1e-9) and swept > float(rows[1]["predicted"])
    report = (tmp_path / "predict.md").read_text()
    # a row's step time is a median: with a line every 10 steps the median step gathers nothing
    assert [predict_validate._log_every(r) for r in ({"log_every": "10", "loop": "disttrain"}, {"log_every": "1"},
                                            {"loop": "hand-written"}, {"loop": "disttrain"})] == [0, 1, 0, 1]
    assert "Not predicted (no 1-rank row to start from): fsdp strong disttrain." in report
    assert [(r["case"], r["gpus"]) for r in rows[6:]] == [("ddp weak disttrain parallel.grad_compression powersgd",
                                                           "1"), ("ddp weak disttrain parallel.grad_compression "
                                                                  "powersgd", "2")]
    low_rank = sm.step_time("ddp", 2, replace(work, grad_compression="powersgd"), net).step_s  # its factors' bytes
    assert float(rows[7]["predicted"]) == pytest.approx(low_rank, rel=1e-9) and low_rank != float(rows[1]["predicted"])
    assert "ddp weak disttrain model.d_model 128 (its sweep of model.d_model is not modelled)" in report
    assert len(rows) == 8  # the other series were predicted
