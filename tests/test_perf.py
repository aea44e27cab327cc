"""The in-run cost figures (perf.py, parallel/comm.py) checked against independent measurements: model FLOPs
against torch's FlopCounterMode, peak memory against a real allocation, communication intervals against real
futures. The multi-rank figures are checked in test_parallel_ddp.py / test_parallel_fsdp.py (same launches)."""

import statistics
import time

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from conftest import SCRIPTS, read_metrics, run_cli
from disttrain.config import ConfigError, ModelConfig, load_config, validate
from disttrain.models.gpt import GPT
from disttrain.parallel.comm import CommMeter
from disttrain.perf import (
    StepMeter,
    comm_overlap,
    flops_per_token,
    peak_for_name,
    peak_memory_gib,
    peak_tflops,
    rank_summary,
    slowest,
    straggler,
)


def counted_flops(model, input_ids) -> int:
    """FLOPs torch counts for one forward and backward: matmuls, and attention as the math kernel computes it (the
    counter does not see inside CPU flash attention)."""
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        out = model(input_ids)
        logits = out.logits if hasattr(out, "logits") else out
        logits.float().sum().backward()
    return counter.get_total_flops()


def test_gpt_flops_per_token_match_torch_flop_counter():
    cfg = ModelConfig(n_layer=3, n_head=4, d_model=96, seq_len=48, vocab_size=300)
    model = GPT(cfg)
    batch = torch.randint(0, 300, (2, 48))
    expected = counted_flops(model, batch) / batch.numel()
    assert flops_per_token(model, 48) == pytest.approx(expected, rel=0.02)


@pytest.mark.parametrize("frozen", ["tok_emb.*,pos_emb.*,blocks.0.*,blocks.1.*", "blocks.1.*", "tok_emb.*",
                                    "*.bias,*ln*", "tok_emb.*,pos_emb.*,blocks.*", "blocks.2.attn.*,blocks.2.ln1.*"])
def test_frozen_parameters_count_no_weight_gradient(frozen):
    """model.freeze: a frozen matmul is forward and input gradient only (4x), forward only (2x, with attention
    forward only) before the first trained parameter; counted as torch counts (6 x every parameter would put MFU at
    1.8x for the first case)."""
    from disttrain.models import freeze

    model = freeze(GPT(ModelConfig(n_layer=3, n_head=4, d_model=96, seq_len=48, vocab_size=300)), frozen)
    batch = torch.randint(0, 300, (2, 48))
    expected = counted_flops(model, batch) / batch.numel()
    assert flops_per_token(model, 48) == pytest.approx(expected, rel=0.02)


def test_hf_llama_flops_per_token_match_torch_flop_counter():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, vocab_size=256,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    batch = torch.randint(0, 256, (2, 40))
    expected = counted_flops(model, batch) / batch.numel()
    assert flops_per_token(model, 40) == pytest.approx(expected, rel=0.02)
    from disttrain.models import freeze

    # the embeddings and the first layer frozen (the head, untied, trains), then only the head trains (its input
    # needs no gradient: 4x); a Llama block registers its norms after attention and MLP, not in forward order
    for frozen in ("model.embed_tokens.*,model.layers.0.*", "model.layers.*,model.norm.*"):
        freeze(model, frozen)
        expected = counted_flops(model, batch) / batch.numel()
        assert flops_per_token(model, 40) == pytest.approx(expected, rel=0.02), frozen


def test_embedding_lookups_are_not_counted_but_a_tied_head_is():
    model = GPT(ModelConfig(n_layer=1, n_head=2, d_model=32, seq_len=16, vocab_size=256))
    everything = sum(p.numel() for p in model.parameters())
    attention = 12 * 1 * 32 * 16
    # the position table is a lookup only; the token table is also the output head (a matmul), counted once
    assert flops_per_token(model, 16) == 6 * (everything - model.pos_emb.weight.numel()) + attention


def test_peak_memory_sees_a_transient_allocation_and_resets():
    device = torch.device("cpu")
    peak_memory_gib(device)
    baseline = peak_memory_gib(device)
    block = torch.ones(64 * 2**20, dtype=torch.uint8)  # 64 MiB, touched
    del block
    assert peak_memory_gib(device) - baseline > 60 / 1024
    assert peak_memory_gib(device) - baseline < 30 / 1024  # the peak was reset to the current resident set


def test_comm_meter_counts_overlapping_collectives_once():
    meter = CommMeter()
    t0 = time.perf_counter()
    first, second = torch.futures.Future(), torch.futures.Future()
    meter.timed(first, 100, t0)
    meter.timed(second, 50, t0 + 0.01)
    time.sleep(0.05)
    first.set_result(None)
    time.sleep(0.05)
    second.set_result(None)
    time.sleep(0.05)
    meter.timed(None, 8, time.perf_counter() - 0.02)  # a synchronous call that took 20 ms, after both
    seconds, nbytes = meter.take()
    assert nbytes == 158
    # the two overlapping intervals (~0.10 s) once, plus the 20 ms one; not the gaps (a loose upper bound: a loaded
    # machine oversleeps)
    assert 0.10 + 0.02 <= seconds < 0.10 + 0.02 + 0.08
    assert meter.take() == (0.0, 0)


class _DeviceWork:
    """What the meter reads of a CUDA collective's Work: whether it finished, and nccl's duration (ms)."""

    def __init__(self, ms: float, finished: bool = True):
        self.ms, self.finished = ms, finished

    def is_completed(self) -> bool:
        return self.finished

    def _get_duration(self) -> float:
        if not self.finished:
            raise RuntimeError("the work has not completed")
        return self.ms


def test_device_meter_holds_only_unfinished_collectives_and_sums_their_durations():
    meter = CommMeter(on_device=True)
    for _ in range(100):  # no take() between them, as in a loop that never reads the figures
        meter.timed(_DeviceWork(2.0), 10, 0.0)
        assert meter.in_flight() <= 1  # each finished one is turned into seconds as the next arrives
    seconds, nbytes = meter.take()
    assert seconds == pytest.approx(0.2) and nbytes == 1000
    meter.timed(_DeviceWork(1.0), 4, 0.0)
    meter.timed(_DeviceWork(1.0, finished=False), 4, 0.0)  # still running when the step is read: not guessed
    assert meter.take() == (None, 8)
    assert meter.take() == (0.0, 0)  # the next step starts from zero


class _DeviceEvent:
    """What the meter reads of a CUDA event: whether the device has passed it, and the ms between two of them."""

    def __init__(self, at_ms: float, passed: bool = True):
        self.at_ms, self.passed = at_ms, passed

    def query(self) -> bool:
        return self.passed

    def elapsed_time(self, end: "_DeviceEvent") -> float:
        if not (self.passed and end.passed):
            raise RuntimeError("an event has not completed")
        return end.at_ms - self.at_ms


def test_device_meter_counts_overlapping_event_timed_collectives_once():
    """FSDP2's all-gathers and reduce-scatters, each timed by events on its own stream, can overlap on the device:
    their union counts, plus the durations of the Works (whose place on the clock nccl does not give)."""
    from disttrain.parallel.comm import _Timing

    meter = CommMeter(on_device=True)
    gather = _Timing(begin=_DeviceEvent(10.0), end=_DeviceEvent(16.0))
    scatter = _Timing(begin=_DeviceEvent(13.0), end=_DeviceEvent(20.0))  # waits for the gather's tail, then runs
    earlier = _Timing(begin=_DeviceEvent(2.0), end=_DeviceEvent(4.0))  # began before the window's first event
    late = _Timing(begin=_DeviceEvent(30.0), end=_DeviceEvent(31.0, passed=False))  # still running when looked at
    for timing in (gather, scatter, earlier, late):
        meter.timed(timing, 8, 0.0)
    assert meter.in_flight() == 1  # the finished ones are spans already, the running one is held
    late.end.passed = True
    meter.timed(_DeviceWork(1.5), 8, 0.0)  # a DDP bucket or the step's totals, timed by nccl
    seconds, nbytes = meter.take()
    assert seconds == pytest.approx((20 - 10 + 4 - 2 + 31 - 30 + 1.5) / 1e3) and nbytes == 40  # 14.5 ms; a sum, 17.5
    assert meter.take() == (0.0, 0)


def test_exposed_communication_from_a_profiled_trace_counts_collective_time_no_kernel_overlaps():
    """`log.profile_steps` on an accelerator: exposed communication from the trace's kernels (microseconds)."""
    def kernel(name, start, end, stream=7):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": start, "dur": end - start, "pid": 0, "tid": stream}

    trace = {"traceEvents": [
        kernel("ampere_sgemm_128x64_tn", 0, 10_000), kernel("elementwise_kernel", 4_000, 6_000),  # nested compute
        kernel("flash_fwd_kernel", 12_000, 20_000),
        kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 8_000, 14_000, stream=21),
        kernel("ncclDevKernel_AllGather_RING_LL", 13_000, 15_000, stream=22),  # overlaps the first: counted once
        kernel("ncclKernel_ReduceScatter_RING_LL_Sum_float", 25_000, 26_000, stream=21),  # nothing beside it
        {"ph": "X", "cat": "cpu_op", "name": "nccl:all_reduce", "ts": 0, "dur": 30_000, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 30_000, "dur": 500, "pid": 0, "tid": 7},
    ]}
    # collectives: [8, 15] + [25, 26] ms = 8 ms; exposed where no other kernel runs: [10, 12] + [25, 26] = 3 ms
    got = comm_overlap(trace, steps=2)
    assert got == pytest.approx({"steps": 2, "comm_s": 4e-3, "comm_exposed_s": 1.5e-3, "comm_hidden_s": 2.5e-3,
                                 "kernels": 6, "collective_kernels": 3})
    assert comm_overlap({"traceEvents": [e for e in trace["traceEvents"] if e["cat"] != "kernel"]}, 2) is None


def test_mfu_needs_a_peak_and_uses_the_given_one():
    model = GPT(ModelConfig(n_layer=1, n_head=2, d_model=32, seq_len=16))
    cpu = torch.device("cpu")
    assert peak_tflops(cpu, "bf16-mixed") is None
    meter = StepMeter(flops_per_token(model, 16), world=2, device=cpu, precision="fp32")
    meter.start()
    out = meter.stop(tokens=1000)
    assert out["mfu"] is None and out["comm_s"] is None and out["tflops"] > 0
    given = StepMeter(flops_per_token(model, 16), world=2, device=cpu, precision="fp32", peak_override=0.5)
    given.start()
    figures = given.stop(tokens=1000)
    expected_tflops = flops_per_token(model, 16) * figures["tokens_per_s"] / 2 / 1e12
    assert figures["tflops"] == pytest.approx(expected_tflops)
    assert figures["mfu"] == pytest.approx(expected_tflops / 0.5)


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H200", 989.0),
    ("NVIDIA GH200 480GB", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA L4", 121.0), ("NVIDIA L40", 181.0),
    ("NVIDIA L40S", 362.0), ("NVIDIA A10", None), ("NVIDIA GeForce RTX 4090", None)])
def test_the_peak_is_the_named_devices_not_one_whose_name_begins_the_same(name, peak):
    """torch.cuda.get_device_name() as CUDA gives it: an L40 is not an L4 (its bf16 peak is 1.5 x the L4's)."""
    assert peak_for_name(name, "bf16") == peak


def test_a_straggler_is_named_only_when_clearly_slower():
    assert straggler({"slowest_ratio": 1.5, "slowest_rank": 3}) == "rank 3 1.5x"
    assert straggler({"slowest_ratio": 1.5, "slowest_rank": 0}) == "rank 0 1.5x"  # rank 0 may be the slow one
    assert straggler({"slowest_ratio": 1.1, "slowest_rank": 3}) == ""
    assert straggler({"step_time_s": 1.0}) == ""  # one process: nothing gathered


def test_work_is_the_step_less_the_time_spent_waiting_for_the_others():
    """The wait is the exposed (blocked) communication on a CPU rank; where a device times the collectives, their
    duration (a rank that arrives first spins in them); nothing where nothing is measured. A logged line carries
    the means since the previous one."""
    class Meter:
        def __init__(self, comm_s, on_device):
            self.comm_s, self.on_device = comm_s, on_device

        def take(self):
            return self.comm_s, 0

    cpu = torch.device("cpu")
    model = GPT(ModelConfig(n_layer=1, n_head=2, d_model=32, seq_len=16))
    for comm, waited in ((None, lambda f: 0.0), (Meter(0.02, True), lambda f: 0.02),
                         (Meter(10.0, False), lambda f: f["comm_exposed_s"])):
        meter = StepMeter(flops_per_token(model, 16), world=2, device=cpu, precision="fp32", comm=comm)
        assert meter.line() == {}  # no step yet
        steps = []
        for _ in range(2):
            meter.start()
            time.sleep(0.05)  # blocked, as a rank waiting in a collective is
            steps.append(meter.stop(tokens=100))
        line = meter.line()
        assert line["waited_s"] == pytest.approx(statistics.mean(waited(f) for f in steps))
        assert line["work_s"] == pytest.approx(statistics.mean(f["step_time_s"] for f in steps) - line["waited_s"])
        assert meter.line() == {}  # counted afresh
    assert steps[0]["comm_exposed_s"] >= 0.04


def test_the_straggler_is_told_by_work_not_by_what_every_rank_waits_alike():
    """Ranks on CUDA whose collectives overlap most of the step (each waits ~0.9 s of 1 s) are balanced, not all
    stragglers; a rank that came 0.4 s late (it waited 0.4 s less than the others) is named, 1 / 0.6 of theirs."""
    assert slowest([0.1, 0.11, 0.1, 0.1], [0.9, 0.89, 0.9, 0.9]) == (1, pytest.approx(1.0 / 0.99))  # not 1.1
    assert slowest([0.1, 0.1, 0.5, 0.1], [0.9, 0.9, 0.5, 0.9]) == (2, pytest.approx(1.0 / 0.6))
    assert slowest([0.0, 0.0], [0.0, 0.0]) == (0, 1.0)  # nothing measured yet
    assert slowest([0.3], [0.1]) == (0, 1.0)  # one rank


def test_the_ranks_largest_exposure_is_null_where_no_rank_measured_it():
    """CUDA leaves comm_exposed_s null (a device-side overlap needs a trace): its maximum over the ranks is null
    too, not 0.0 (an H200 run logged comm_exposed_s null next to comm_exposed_s_max 0.0)."""
    cpu = torch.device("cpu")
    assert rank_summary({"step_time_s": 0.1, "comm_exposed_s": None}, cpu, False)["comm_exposed_s_max"] is None
    assert rank_summary({"step_time_s": 0.1, "comm_exposed_s": 0.02}, cpu, False)["comm_exposed_s_max"] == 0.02
    assert rank_summary({"step_time_s": 0.1, "comm_exposed_s": 0.0}, cpu, False)["comm_exposed_s_max"] == 0.0


@pytest.mark.parametrize("value", ["x", "0", "5-3", "3-"])
def test_bad_profile_steps_are_refused_in_one_line(value):
    with pytest.raises(ConfigError, match="log.profile_steps"):
        validate(load_config(None, [f'log.profile_steps="{value}"']))


def test_powersgd_is_refused_under_fsdp_in_one_line():
    cfg = load_config(None, ["parallel.strategy=fsdp", "parallel.grad_compression=powersgd", "dist.nproc=2",
                             "data.micro_batch_size=4"])
    with pytest.raises(ConfigError, match="grad_compression = 'powersgd'.*'bf16' or 'fp16'"):
        validate(cfg)


@pytest.fixture(scope="module")
def perf_runs(tmp_path_factory):
    """tests/scripts/perf_job.py on 2 ranks: the leak check's runs and the straggler's, one launch."""
    tmp = tmp_path_factory.mktemp("perf")
    result = run_cli(["launch", "--fork", "--nproc", "2", "--run-dir", str(tmp / "launch"),
                      str(SCRIPTS / "perf_job.py"), str(tmp)], tmp, timeout=240)
    assert result.returncode == 0, result.stderr
    (tmp / "launch.log").write_text(result.stdout + result.stderr)
    return tmp


def test_no_memory_leak_over_200_steps_and_a_leak_is_seen(perf_runs):
    """Peak memory per rank after warm-up (steps 21-40) against the last 20 of 200 steps: the training loop grows
    by less than 1%; the same loop with a loss function that keeps 512 KiB per call grows visibly (the control)."""
    def growth(name: str) -> float:
        peaks = [m["mem_peak_gib_max"] for m in read_metrics(perf_runs / name)]
        assert len(peaks) == 200
        return max(peaks[180:]) / max(peaks[20:40])

    assert growth("steady") < 1.01
    assert growth("leaky") > 1.05


def test_a_rank_that_computes_longer_is_named_though_every_rank_steps_as_long(perf_runs):
    """Rank 1 burns 20 ms of CPU per micro-batch, under ddp and under fsdp. Every rank's step then takes as long
    (rank 0 waits in the gradients' collectives), so step times cannot tell the straggler; the work (the step less
    the time waited) does: rank 1 is named on every line after the first steps. A balanced job of 14-20 ms steps, a
    line every 10 steps (the default; a line's work is the mean since the previous one): no rank is named, but for
    one line at most (the 3 ms steps of the other runs, on 2 shared cores, vary by 20% from step to step). The
    end-of-run line names the straggler where it was named on a quarter of the lines or more."""
    for run in ("straggler", "straggler_fsdp"):  # (fsdp: the waits are spread over every block's collectives)
        records = read_metrics(perf_runs / run)[3:]
        assert len(records) == 17
        steps = [r["step_time_max_s"] / r["step_time_s"] for r in records]
        assert statistics.median(steps) < 1.2  # rank 0's step is as long as the slowest's
        # named from 1.2; seen here: ddp 3-8 x, fsdp 1.7-2.9 x on every line (one may miss: a preempted rank 0)
        missed = [r for r in records if r["slowest_rank"] != 1 or not straggler(r).startswith("rank 1 ")]
        assert len(missed) <= 1, (run, missed)
    named = [straggler(r) for r in read_metrics(perf_runs / "balanced")]
    assert len(named) == 6 and sum(map(bool, named)) <= 1, named
    # the end-of-run line says it too: the straggler runs name rank 1 on every line but the first few, the others none
    summaries = [line for line in (perf_runs / "launch.log").read_text().splitlines() if "done: steps" in line]
    assert len(summaries) == 5, summaries  # steady, leaky, straggler, straggler_fsdp, balanced (rank 0 logs them)
    assert [("straggler: rank 1 on " in line) for line in summaries] == [False, False, True, True, False], summaries
