"""`disttrain bench gpu`: the no-GPU path, and the parts that need no GPU (the micro-batch picker, the runner, the
report, a check's training loop on CPU). The CUDA checks themselves run only on a GPU machine."""

import pytest
import torch

from conftest import run_cli
from disttrain.bench import gpu
from disttrain.cli.main import main
from disttrain.memory import estimate

TINY = {"n_layer": 2, "d_model": 64, "n_head": 4, "seq_len": 64, "vocab_size": 256}


def test_without_a_gpu_says_so_and_writes_nothing(tmp_path):
    result = run_cli(["bench", "gpu", "--out", str(tmp_path / "gpu.md")], tmp_path, timeout=60,
                     env={"CUDA_VISIBLE_DEVICES": ""})  # the no-GPU path, also on a machine that has one
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == gpu.NO_GPU
    assert not (tmp_path / "gpu.md").exists() and not (tmp_path / "docs").exists()


def test_micro_batch_picker_takes_the_largest_power_of_two_that_fits():
    def total(micro):
        return estimate(gpu.kit.config(TINY, micro, "single", "bf16-mixed"), 1, "single").total(False)

    assert total(8) < total(16)
    assert gpu.memory.pick_micro_batch(TINY, "bf16-mixed", total(8)) == 8  # exactly the estimate fits
    assert gpu.memory.pick_micro_batch(TINY, "bf16-mixed", total(16) - 1) == 8
    assert gpu.memory.pick_micro_batch(TINY, "bf16-mixed", total(1) - 1) is None  # not even one sequence
    assert gpu.memory.pick_micro_batch(TINY, "bf16-mixed", 1e15, limit=32) == 32


def test_a_failing_check_is_reported_and_the_others_still_run():
    def breaks(args, check):
        check.figures["before"] = "1.0 ms"
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")

    def passes(args, check):
        check.passed, check.reason = True, "target"

    released = []
    checks = gpu.run_checks([("a", breaks), ("b", passes)], None, release=lambda: released.append(1))
    assert [(c.name, c.passed) for c in checks] == [("a", False), ("b", True)] and len(released) == 2
    assert checks[0].reason == "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert checks[0].figures == {"before": "1.0 ms"}  # what came before the failure is kept

    report = gpu.render(checks, {"date": "2026-11-23", "device": "NVIDIA H100 80GB HBM3"}, "disttrain bench gpu")
    assert "| date | 2026-11-23 |" in report and "| device | NVIDIA H100 80GB HBM3 |" in report
    assert "| a | FAIL |" in report and "| b | PASS |" in report
    assert "## a: FAIL" in report and "- before: 1.0 ms" in report and "- reason: OutOfMemoryError" in report
    assert "## b: PASS" in report and "- target: target" in report and "1 of 2 checks passed." in report


def test_a_check_that_cannot_run_here_is_skipped_not_failed():
    def needs_ray(args, check):
        raise gpu.Skipped("ray is not installed (disttrain[ray])")

    [check] = gpu.run_checks([("service ray", needs_ray)], None)
    assert check.skipped and not check.passed and check.reason == "ray is not installed (disttrain[ray])"
    report = gpu.render([check], {}, "disttrain bench gpu")
    assert "| service ray | SKIP |" in report and "0 of 1 checks passed, 1 skipped." in report


def test_defaults_are_the_issues_sizes():
    args = gpu._args([])
    assert gpu.memory.mfu_size(args) == {"n_layer": 24, "d_model": 2048, "n_head": 16, "seq_len": 2048,
                                  "vocab_size": 50304}
    assert args.out == "docs/benchmarks/gpu.md" and args.compile and args.mfu_precision == "bf16-mixed"
    assert [name for name, _ in gpu.CHECKS] == ["nccl", "steps bf16-mixed", "steps fp16-mixed", "steps bf16-true",
                                                "queued step", "memory single", "memory ddp", "memory fsdp",
                                                "memory compiled", "comm none", "comm bf16", "comm fsdp",
                                                "comm trace", "checkpoint", "overhead", "overhead medium", "tp",
                                                "pp 1f1b", "pp interleaved-1f1b", "pp zbv", "pp dualpipev",
                                                "pp zbv x tp", "cpu_offload", "mfu",
                                                "mfu fsdp", "mfu blocks", "service ray"]


def test_the_checks_of_compiled_blocks_skip_under_no_compile():
    """`memory compiled` and `mfu blocks` measure what parallel.compile does: with --no-compile each skips in a line
    before touching the device (here a CPU, which they would otherwise fail on)."""
    args = gpu._args(["--no-compile"])
    args.device = torch.device("cpu")
    checks = [(name, fn) for name, fn in gpu.CHECKS if name in ("memory compiled", "mfu blocks")]
    done = gpu.run_checks(checks, args)
    assert [c.name for c in done] == ["memory compiled", "mfu blocks"]
    assert all(c.skipped and c.reason == "--no-compile: this check measures compiled blocks" for c in done), done


@pytest.mark.parametrize("precision", ["fp16-mixed"])
def test_the_steps_check_trains_on_cpu(precision):
    """The check's loop through create_backend (fp16: GradScaler, skipped steps) runs on a CPU as well."""
    args = gpu._args([])
    args.device = torch.device("cpu")
    [check] = gpu.run_checks([(precision, lambda a, c: gpu.check_steps(a, c, precision, size=TINY, micro=4))], args)
    assert check.passed, (check.reason, check.figures)
    assert 0 < int(check.figures["skipped steps"]) < 20 and float(check.figures["final loss scale"]) < 65536


def test_the_queued_step_check_runs_on_a_one_rank_cpu_group():
    """What `queued step` checks on the GPU, on a one-rank gloo group under ddp and fsdp: the queued step against
    the one that reads first, refused steps, a foreach state resumed by the fused optimizer (the host waits are
    counted on CUDA only)."""
    import torch.distributed as dist

    args = gpu._args([])
    args.device = torch.device("cpu")
    try:
        [check] = gpu.run_checks([("queued step", lambda a, c: gpu.check_queued_step(a, c, size=TINY, micro=4))],
                                 args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert check.passed, (check.reason, check.figures)
    for strategy in ("ddp", "fsdp"):
        assert check.figures[f"{strategy}: a refused step (NaN loss / NaN gradients) leaves the state as it was"] == (
            "True / True")
        assert not any(k.startswith(f"{strategy}: host waits") for k in check.figures)


@pytest.mark.parametrize("tensor_parallel,schedule", [(True, ""), (True, "dualpipev")])
def test_the_split_check_runs_the_tensor_and_pipeline_engines_on_one_cpu_rank(tensor_parallel, schedule):
    """What the tp/pp checks run on the GPU, on a one-rank gloo group: both V stages on this rank, parameters as
    DTensors, the losses of the plain model."""
    import torch.distributed as dist

    args = gpu._args([])
    args.device = torch.device("cpu")
    try:
        [check] = gpu.run_checks([("split", lambda a, c: gpu.check_split(a, c, tensor_parallel, schedule,
                                                                           size=TINY, steps=3))], args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert check.passed, (check.reason, check.figures)
    assert check.figures["backend"] == "gloo" and int(check.figures["parameters that are DTensors"]) > 0
    assert check.figures.get("stages on this rank") == ("[0, 1] of 2" if schedule else None)


def test_the_checkpoint_check_resumes_an_async_fsdp_save_bit_for_bit_on_a_one_rank_cpu_group():
    import torch.distributed as dist

    args = gpu._args([])
    args.device = torch.device("cpu")
    try:
        [check] = gpu.run_checks([("checkpoint", lambda a, c: gpu.check_checkpoint(a, c, size=TINY, micro=4))], args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert check.passed, (check.reason, check.figures)
    assert check.figures["loaded state"] == "equal bit for bit"


def test_a_rerun_keeps_the_notes_above_the_marker(tmp_path):
    report = tmp_path / "gpu.md"
    assert gpu.kept_notes(report) == ""  # no file yet
    report.write_text("# old report\n| nccl | PASS |\n")
    assert gpu.kept_notes(report) == ""  # no marker: the whole file is the report
    report.write_text(f"# notes\nfound a bug\n{gpu.NOTES_END}\n\n# old report\n")
    assert gpu.kept_notes(report) == f"# notes\nfound a bug\n{gpu.NOTES_END}\n\n"


def test_the_comm_trace_check_profiles_ddp_steps_and_finds_no_kernels_on_cpu():
    """Its path (a one-rank group, DDP steps under StepProfiler) runs on a CPU too, where the trace has no kernels:
    FAIL with that reason (on a GPU its nccl kernels are measured: docs/benchmarks/gpu.md)."""
    args = gpu._args([])
    args.device = torch.device("cpu")
    [check] = gpu.run_checks([("comm trace", lambda a, c: gpu.check_comm_trace(a, c, size=TINY, micro=4))], args)
    assert not check.passed and check.reason == "the trace has no kernels", check.reason


def test_the_overhead_check_runs_both_loops_over_a_one_rank_group_on_cpu_and_profiles_them():
    """`bench overhead`'s loops in this process over a one-rank group (at --nproc 1 `bench overhead` itself failed:
    its hand-written DDP found no process group). On a CPU only the path is checked, not the ratio. A strategy over
    its target gets a profile of both loops (forced here); on a CPU there are no CUDA runtime calls, and the
    operators are the loops' own (aten's)."""
    args = gpu._args([])
    args.device = torch.device("cpu")
    [check] = gpu.run_checks([("overhead", lambda a, c: gpu.check_overhead(a, c, ("ddp", "fsdp"), 2, 1, size=TINY,
                                                                          profile=True, profile_steps=2))], args)
    ratios = [v for k, v in check.figures.items() if k.endswith("median step")]
    assert len(ratios) == 2 and all(" ms, ratio " in v for v in ratios), check.figures
    costs = [v for k, v in check.figures.items() if "the figures' cost, disttrain without / with them" in k]
    assert len(costs) == 2 and all(" ms, ratio " in v and "<= 1.02" in v for v in costs), check.figures
    assert check.reason.startswith("ratios of median" if check.passed else "over 1.02: "), check.reason
    for strategy in ("ddp", "fsdp"):
        assert check.figures[f"{strategy}: CUDA runtime calls per step (hand-written / disttrain)"] == "none (no CUDA)"
        walls = check.figures[f"{strategy}: profiled, per step (hand-written / disttrain)"]
        assert " wall under the profiler, " in walls and walls.endswith("2 steps each, built first and built second")
        differ = check.figures[f"{strategy}: host time per step, the operators that differ most (hand-written / "
                               "disttrain, us; calls)"].split("; ")
        assert len(differ) == 8 and any(d.startswith("aten::") for d in differ), differ


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_bare_loop_is_disttrains_step_without_its_figures(tmp_path, strategy):
    """`bench overhead`'s third loop: the same step with no communication meter (comm_s and comm_bytes null where
    the step as it runs measures them), and `comm.meter_for` as it was once the loop is built."""
    import argparse

    from disttrain.bench import loops, overhead
    from disttrain.data import GlobalSampler, build_datasets
    from disttrain.parallel import comm

    runtime = gpu.kit.runtime(torch.device("cpu"), group=True)  # the one-rank group of the overhead check
    bench = argparse.Namespace(global_batch=4, micro=2, nproc=1, out=str(tmp_path), rounds=2, steps=1, set=[])
    cfg = overhead.job_config(bench, strategy, ("model.n_layer=1", "model.d_model=32", "model.n_head=2"))
    train, _ = build_datasets(cfg.data, cfg.model.seq_len)
    metered = comm.meter_for
    figures = {name: loops.LOOPS[name](cfg, runtime, train, GlobalSampler(len(train), cfg.run.seed))(0)
               for name in ("disttrain", "bare")}
    assert comm.meter_for is metered
    assert figures["disttrain"]["comm_s"] is not None and figures["disttrain"]["comm_bytes"] is not None
    if strategy == "ddp":  # (FSDP2 at one rank issues no collective: 0 s, 0 bytes)
        assert figures["disttrain"]["comm_s"] > 0 and figures["disttrain"]["comm_bytes"] > 0
    assert figures["bare"]["comm_s"] is None and figures["bare"]["comm_bytes"] is None
    assert figures["bare"]["loss"] == figures["disttrain"]["loss"]  # the same step otherwise


@pytest.mark.parametrize("args, says", [
    (["--steps", "0"], "--steps 0: must be >= 1"),
    (["--memory-fraction", "nan"], "--memory-fraction nan: give a share"),
    (["--peak-tflops", "-1"], "--peak-tflops -1: must be >= 0"), (["--only", ","], "--only ',' names no check"),
    (["--d-model", "100"], "--d-model 100 is not divisible by --n-head 16"),
])
def test_bad_numbers_are_refused_before_the_device_is_looked_for(tmp_path, capsys, args, says):
    assert main(["bench", "gpu", *args, "--out", str(tmp_path / "gpu.md")]) == 2  # (with or without a GPU)
    err = capsys.readouterr().err.strip()
    assert err.startswith("disttrain: error: " + says) and "\n" not in err, err
    assert not (tmp_path / "gpu.md").exists()


def test_only_runs_the_named_checks_and_refuses_an_unknown_one(tmp_path):
    assert [name for name, _ in gpu.selected("overhead, comm trace")] == ["comm trace", "overhead"]
    assert gpu.selected("") == gpu.CHECKS
    result = run_cli(["bench", "gpu", "--only", "overhed", "--out", str(tmp_path / "gpu.md")], tmp_path, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "--only 'overhed'" in result.stderr and "overhead" in result.stderr and len(result.stderr.splitlines()) == 1
    assert not (tmp_path / "gpu.md").exists()
    result = run_cli(["bench", "gpu", "--only", "overhead"], tmp_path, timeout=60)  # the full report is kept
    assert result.returncode == 2 and "give --out FILE" in result.stderr, result.stderr
