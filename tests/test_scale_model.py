"""The scale model as arithmetic: collective formulas, the fit and the node hierarchy (bench/interconnect.py), each
strategy's bytes and overlap (bench/scale_model.py), and the published scaling it must reproduce. No process, no
torch in the model."""

import math
import subprocess
import sys
from dataclasses import replace

import pytest

from disttrain.bench import buckets, timeline
from disttrain.bench import interconnect as ic
from disttrain.bench import scale_model as sm
from disttrain.bench.model_shapes import MODELS, ModelShape, UnitShape, gpt_shape, joined
from disttrain.bench.model_split import split_shape
from disttrain.bench.published_scaling import PUBLISHED
from disttrain.errors import ConfigError

NET = ic.PRESETS["h100-nvlink+ib-ndr"]
LLAMA = MODELS["llama3-8b"]


def flat(link: ic.Link, gpus_per_node: int = 8) -> ic.Interconnect:
    return ic.Interconnect("flat", gpus_per_node, ic.uniform(link), ic.uniform(link))


def test_bus_factors_are_nccl_tests_definitions():
    assert ic.bus_factor("all_reduce", 4) == 2 * 3 / 4
    for collective in ("all_gather", "reduce_scatter", "all_to_all"):
        assert ic.bus_factor(collective, 4) == 3 / 4
    assert ic.bus_factor("broadcast", 4) == 1.0


def test_ring_all_reduce_cost_is_alpha_beta_formula():
    link = ic.Link(3e-6, 100e9)
    for n in (2, 3, 8):
        nbytes = 123e6
        expected = 2 * (n - 1) * 3e-6 + 2 * (n - 1) / n * nbytes / 100e9
        assert ic.collective_time("all_reduce", nbytes, n, flat(link)) == pytest.approx(expected, rel=1e-12)
        assert ic.collective_time("all_gather", nbytes, n, flat(link)) == pytest.approx(
            (n - 1) * 3e-6 + (n - 1) / n * nbytes / 100e9, rel=1e-12)
    assert ic.collective_time("all_reduce", 1e9, 1, NET) == 0.0


def test_hierarchy_makes_crossing_nodes_slower_and_reduces_to_the_ring_on_equal_links():
    per_byte = {n: ic.collective_time("all_reduce", 1e9, n, NET) for n in (8, 16, 128)}
    assert per_byte[8] < per_byte[16] < per_byte[128]  # IB NDR (50 GB/s per GPU) is the bottleneck across nodes
    inside = ic.collective_time("all_reduce", 1e9, 8, NET)
    assert per_byte[16] > 1.5 * inside
    zero_latency = ic.Link(0.0, 10e9)
    for collective in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        hierarchical = ic.collective_time(collective, 1e9, 32, flat(zero_latency, gpus_per_node=4))
        ring = ic.collective_time(collective, 1e9, 32, flat(zero_latency, gpus_per_node=32))
        assert hierarchical == pytest.approx(ring, rel=1e-12), collective


def test_fit_recovers_alpha_beta_and_weighs_small_sizes():
    sizes = [2.0**k for k in range(10, 29, 2)]
    times = [50e-6 + 1e-9 * s for s in sizes]
    alpha, beta = ic.fit_alpha_beta(sizes, times)
    assert alpha == pytest.approx(50e-6, rel=1e-9) and beta == pytest.approx(1e-9, rel=1e-9)
    noisy = [t * (1.1 if i % 2 else 0.9) for i, t in enumerate(times)]
    alpha, beta = ic.fit_alpha_beta(sizes, noisy)
    assert 40e-6 < alpha < 60e-6 and 0.8e-9 < beta < 1.2e-9  # a plain least squares would lose alpha entirely
    assert ic.fit_alpha_beta([1e3, 1e4], [1e-3, 0.9e-3]) == (pytest.approx(0.947e-3, rel=1e-2), 0.0)  # clamped


def test_fsdp_moves_one_and_a_half_times_ddp_bytes_in_fp32():
    work = sm.Workload(LLAMA, 1.0, 8192, precision="fp32")
    ddp = sm.step_time("ddp", 64, work, NET).wire_bytes
    fsdp = sm.step_time("fsdp", 64, work, NET).wire_bytes
    figures = 63 / 64 * 40 * 64 / 10  # each logged line (every 10 steps by default) all-gathers 5 float64 per rank
    assert ddp == pytest.approx(2 * 63 / 64 * LLAMA.params * 4 + figures, rel=1e-12)
    blocks = LLAMA.n_layer * LLAMA.layer_params  # gathered for forward and again for backward, then reduce-scattered
    norm = 2 * 63 / 64 * 8  # sharded gradients: their norm is all-reduced (float64) in the optimizer step
    assert fsdp == pytest.approx(63 / 64 * 4 * (3 * blocks + 2 * LLAMA.root_params) + norm + figures, rel=1e-12)
    assert 1.4 * ddp < fsdp <= 1.5 * ddp  # ZeRO's 1.5x, less the root's second gather
    assert sm.step_time("zero2", 64, work, NET).wire_bytes < fsdp


def test_gradient_compression_sends_two_bytes_an_element_and_buckets_set_the_calls():
    work = sm.Workload(LLAMA, 1.0, 8192, precision="fp32", log_every=0)
    for strategy, collective in (("ddp", "all_reduce"), ("fsdp", "reduce_scatter")):
        plain = sm.step_time(strategy, 64, work, NET).wire_bytes
        for compression in ("fp16", "bf16"):
            halved = sm.step_time(strategy, 64, replace(work, grad_compression=compression), NET).wire_bytes
            assert plain - halved == pytest.approx(ic.bus_factor(collective, 64) * LLAMA.params * 2, rel=1e-9)
    cpu = ic.interconnect_from_fit({"world_size": 2, "backend": "gloo", "device": "cpu", "collectives": {
        c: {"alpha_s": 2e-3, "beta_s_per_byte": 1e-9} for c in ic.COLLECTIVES}})
    shape = gpt_shape(2, 64, 32, 256)  # 0.43 MB of fp32 gradients
    one, many = (sm.step_time("ddp", 2, sm.Workload(shape, 0.05, 1, "fp32", bucket_bytes=b, cpu_cores=2,
                                                    log_every=0), cpu) for b in (25 * 2**20, 2**16))
    calls = math.ceil(shape.params * 4 / 2**16)  # a call's alpha for each bucket, the bytes the same
    assert many.comm_s - one.comm_s == pytest.approx((calls - 1) * 2e-3, rel=1e-9)
    assert many.wire_bytes == pytest.approx(one.wire_bytes, rel=1e-12)


def test_a_cpu_host_pays_the_cpu_time_of_the_buckets_issued_during_backward():
    # every core running a rank, the CPU time per call measured: a bucket issued while backward goes on costs its
    # CPU time (gloo's threads take the cores), its waiting overlaps the compute; the last one issued is waited for
    alpha, beta, cpu_alpha, cpu_beta = 2e-3, 1e-9, 5e-4, 2e-9
    fit = {"world_size": 2, "backend": "gloo", "device": "cpu", "collectives": {
        c: {"alpha_s": alpha, "beta_s_per_byte": beta} for c in ic.COLLECTIVES}}
    timed = {**fit, "collectives": {c: {**f, "cpu_alpha_s": cpu_alpha, "cpu_beta_s_per_byte": cpu_beta}
                                    for c, f in fit["collectives"].items()}}
    wall, cpu = ic.interconnect_from_fit(fit), ic.interconnect_from_fit(timed)
    assert wall.cpu is None and ic.collective_time("all_reduce", 1e6, 2, replace(cpu, intra=cpu.cpu)) == \
        pytest.approx(cpu_alpha + cpu_beta * 1e6, rel=1e-12)
    shape = gpt_shape(2, 64, 32, 256)
    work = sm.Workload(shape, 0.05, 1, "fp32", bucket_bytes=2**16, cpu_cores=2, log_every=0)
    sizes = buckets.gradient_buckets(shape, 4, 2**16)
    assert len(sizes) > 2
    before = sm.step_time("ddp", 2, work, wall)
    after = sm.step_time("ddp", 2, work, cpu)
    assert before.step_s == pytest.approx(0.05 + sum(alpha + beta * b for b in sizes), rel=1e-12)
    assert after.step_s == pytest.approx(0.05 + alpha + beta * sizes[0]  # the first parameters' bucket: the last
                                         + sum(cpu_alpha + cpu_beta * b for b in sizes[1:]), rel=1e-12)
    assert after.comm_s == before.comm_s and after.wire_bytes == before.wire_bytes
    assert sm.step_time("zero1", 2, work, cpu).step_s == pytest.approx(  # DDP's buckets, then its exposed all-gather
        after.step_s + ic.collective_time("all_gather", shape.params * 4, 2, cpu), rel=1e-12)
    one = replace(work, bucket_bytes=25 * 2**20)  # one bucket, waited for whole: as without the CPU time
    assert sm.step_time("ddp", 2, one, cpu).step_s == sm.step_time("ddp", 2, one, wall).step_s
    for strategy in ("fsdp", "zero2"):  # FSDP's collectives block the step: their whole time, as before
        assert sm.step_time(strategy, 2, work, cpu).step_s == sm.step_time(strategy, 2, work, wall).step_s
    partial = {**fit, "collectives": {**fit["collectives"], "all_reduce": timed["collectives"]["all_reduce"]}}
    assert ic.interconnect_from_fit(partial).cpu is None  # (a fit with some CPU times: none used, none claimed)
    assert "CPU time" not in ic.interconnect_from_fit(partial).note and "CPU time" in cpu.note
    with pytest.raises(ConfigError, match="all_gather's cpu_alpha_s and cpu_beta_s_per_byte must be finite"):
        ic.interconnect_from_fit({**timed, "collectives": {**timed["collectives"], "all_gather": {
            "alpha_s": alpha, "beta_s_per_byte": beta, "cpu_alpha_s": -1.0, "cpu_beta_s_per_byte": 0.0}}})


def test_each_collective_is_priced_with_the_links_of_its_element_type():
    # float32 links, and bfloat16's slower per byte (gloo's, measured: bench comm --dtype); float16 not measured
    def links(beta: float) -> dict:
        return {c: {"alpha_s": 1e-3, "beta_s_per_byte": beta} for c in ("all_reduce", "all_gather", "reduce_scatter")}
    fit = {"world_size": 2, "backend": "gloo", "device": "cpu", "collectives": links(1e-9)}
    plain, measured = ic.interconnect_from_fit(fit), ic.interconnect_from_fit({**fit, "dtypes": {"bfloat16": links(
        4e-9)}})
    assert "float32, and bfloat16 where sent" in measured.note
    three = ic.with_gpus_per_node(measured, 3)  # (every rank on one host, as --validate takes it: one ring)
    assert ic.collective_time("all_reduce", 1e6, 3, three.for_dtype("bfloat16", "all_reduce")) == pytest.approx(
        1e-3 + 4e-9 * 1e6 * 2 * 2 / 3 / ic.bus_factor("all_reduce", 2), rel=1e-12)
    shape = gpt_shape(2, 64, 32, 256)
    grads = shape.params  # elements, in one bucket
    for compression, extra in (("bf16", 3e-9 * grads * 2), ("fp16", 0.0), ("none", 0.0)):
        work = sm.Workload(shape, 0.05, 1, "fp32", grad_compression=compression, log_every=0)
        moved = sm.step_time("ddp", 2, work, measured).step_s - sm.step_time("ddp", 2, work, plain).step_s
        assert moved == pytest.approx(extra, rel=1e-9, abs=1e-15)  # the bucket's 2-byte elements at bfloat16's beta
    mixed = sm.Workload(shape, 0.05, 1, "bf16-mixed", log_every=0)  # FSDP gathers bfloat16, reduces float32
    a, b = (sm.step_time("fsdp", 2, mixed, net) for net in (plain, measured))
    gathered = sum(u.params * 2 * (2 if i > 0 else 1) for i, u in enumerate(shape.units()))  # (the root once)
    assert b.comm_s - a.comm_s == pytest.approx(3e-9 * gathered, rel=1e-9)
    assert sm.step_time("fsdp", 2, replace(mixed, precision="fp32"), measured).step_s == \
        sm.step_time("fsdp", 2, replace(mixed, precision="fp32"), plain).step_s  # float32 throughout: unchanged
    with pytest.raises(ConfigError, match="dtype 'float64' is not one of float32, bfloat16, float16"):
        ic.interconnect_from_fit({**fit, "dtypes": {"float64": links(1e-9)}})


def test_powersgd_sends_each_bucket_as_its_whole_tensors_then_p_then_q():
    # two blocks, each of a 64 x 256 matrix, a 64-vector, an 8 x 8 matrix and a 256-vector (float32): the 8 x 8 one
    # compressed at rank 1 ((8 + 8) x 1 x 2 < 64), sent whole at rank 4 (16 x 4 x 2 > 64), the big one at both
    tensors, rows = (64 * 256, 64, 8 * 8, 256) * 2, (64, 0, 8, 0) * 2
    shape = ModelShape("toy", sum(tensors), counted=(UnitShape(sum(tensors) / 2, sum(tensors) / 2, 1, 2),) * 2,
                          grad_tensors=tensors, grad_rows=rows)
    links = ic.uniform(ic.Link(0.0, 1e9, call_s=1e-3))  # a call's 1 ms, then 1 ns a bus byte
    net = ic.Interconnect("cpu", 2, links, links)
    gpu = replace(net, intra=ic.uniform(ic.Link(1e-3, 1e9)), inter=ic.uniform(ic.Link(1e-3, 1e9)))
    work = sm.Workload(shape, 0.05, 1, "fp32", grad_compression="powersgd", log_every=0, cpu_cores=2,
                       bucket_bytes=64 * 256 * 4)
    grads, calls = buckets.bucket_calls(shape, work, 4, 4)
    whole, p, q = 2 * (64 + 256), 2 * (64 + 8), 2 * (256 + 8)  # both blocks in one bucket on a CPU (gloo)
    assert grads == [sum(tensors) * 4] and calls == [[4 * whole, 4 * p, 4 * q]]
    assert sm.step_time("ddp", 2, work, net).comm_s == pytest.approx(3e-3 + 4e-9 * (whole + p + q), rel=1e-12)
    four = replace(work, powersgd_rank=4, cpu_cores=0)  # on GPUs: DDP's buckets, here one per block
    grads, calls = buckets.bucket_calls(shape, four, 4, 4)
    assert calls == [[4 * (64 + 64 + 256), 4 * 4 * 64, 4 * 4 * 256]] * 2
    plain = sm.step_time("ddp", 2, replace(four, grad_compression="none"), gpu)
    low = sm.step_time("ddp", 2, four, gpu)
    assert plain.wire_bytes - low.wire_bytes == pytest.approx(4 * 2 * (64 * 256 - 4 * (64 + 256)), rel=1e-12)
    hops = 2 * 1e-3  # a 2-rank ring all-reduce: 2 steps
    assert low.comm_s == pytest.approx(2 * (3 * hops + (4 * (64 + 64 + 256) + 4 * 4 * (64 + 256)) / 1e9), rel=1e-12)
    # on GPUs the hook synchronizes the device at each bucket: its calls hold up the backward, none hides behind it
    assert low.step_s == pytest.approx(0.05 + low.comm_s, rel=1e-12)
    assert plain.step_s < 0.05 + plain.comm_s  # (the plain all-reduce of the second bucket overlaps the backward)
    with pytest.raises(ConfigError, match="the shapes of big's gradients are not known"):
        sm.step_time("ddp", 2, replace(work, model=ModelShape("big", 1e6)), net)
    with pytest.raises(ConfigError, match="'powersgd' is a DDP communication hook: zero2 does not run it"):
        sm.step_time("zero2", 2, work, net)


def test_ddp_buckets_hold_whole_tensors_from_the_last_parameter():
    # as DDP's rebuilt buckets: in the order gradients are ready, closed once they reach the cap
    model = ModelShape("m", 1030, counted=(UnitShape(1030, 1030, 1, 2),), grad_tensors=(10, 10, 1000, 10))
    assert buckets.gradient_buckets(model, 4, 40) == [40, 40, 4000, 40]  # forward order; an even split would make 103
    assert buckets.gradient_buckets(model, 4, 100) == [80, 4040]  # the first parameters' bucket is the partial one
    assert buckets.gradient_buckets(model, 4, 25 * 2**20) == [4120]


def test_ddp_hides_the_all_reduce_behind_backward_except_the_last_bucket():
    link = ic.Link(0.0, 1e9)  # 1 GB/s, so the bytes decide
    model = ModelShape("m", 100e6 / 4)  # 100 MB of fp32 gradients = 4 buckets of 25 MiB (+ a partial one)
    work = sm.Workload(model, compute_s=10.0, tokens=1, precision="fp32")
    sizes = buckets.gradient_buckets(model, 4, work.bucket_bytes)
    last = ic.collective_time("all_reduce", sizes[0], 2, flat(link))
    figures = ic.collective_time("all_gather", 40 * 2, 2, flat(link))  # the logged line's, after the step
    step = sm.step_time("ddp", 2, work, flat(link))
    assert step.step_s == pytest.approx(10.0 + last + figures / 10, rel=1e-9)  # the rest fits in the 6.7 s backward
    assert sm.step_time("ddp", 2, replace(work, log_every=1), flat(link)).step_s == pytest.approx(
        10.0 + last + figures, rel=1e-9)
    slow = sm.step_time("ddp", 2, sm.Workload(model, 0.03, 1, "fp32"), flat(link))
    first_ready = 0.02 * sizes[-1] / sum(sizes)  # backward (2/3 of 0.03 s) until the first bucket is complete
    assert slow.step_s == pytest.approx(0.01 + first_ready + slow.comm_s, rel=1e-9)  # then the collectives back to back


def test_a_cpu_step_pays_a_call_for_each_blocking_collective():
    # gloo on one host, every core running a rank: nothing overlaps, and each call costs its alpha however small
    alpha, beta = 2e-3, 1e-9
    net = ic.with_gpus_per_node(ic.interconnect_from_fit({"world_size": 2, "backend": "gloo", "device": "cpu",
        "collectives": {c: {"alpha_s": alpha, "beta_s_per_byte": beta} for c in ic.COLLECTIVES}}), 3)
    shape = gpt_shape(2, 64, 32, 256)
    work = sm.Workload(shape, 0.05, 1, "fp32", cpu_cores=2, log_every=1)  # a line every step
    grads = shape.params * 4
    figures = alpha + beta * 40 * 2  # the logged line's all-gather of the ranks' figures (5 float64 each)
    ddp = sm.step_time("ddp", 2, work, net)  # one bucket
    assert ddp.step_s == pytest.approx(0.05 + alpha + beta * grads + figures, rel=1e-12)
    assert sm.step_time("ddp", 2, replace(work, log_every=0), net).step_s == pytest.approx(
        0.05 + alpha + beta * grads, rel=1e-12)
    fsdp = sm.step_time("fsdp", 2, work, net)  # 1 + 2 x 2 gathers, 3 reduce-scatters, the gradient norm's all-reduce
    calls = (1 + 2 * 2) + 3 + 1 + 1
    moved = 4 * (shape.root_params + 2 * 2 * shape.layer_params) + grads + 8 + 40 * 2
    assert fsdp.comm_s == pytest.approx(calls * alpha + beta * moved, rel=1e-12)
    assert sm.step_time("ddp", 3, work, net).step_s == pytest.approx(  # 3 ranks on 2 cores: all of it x 1.5
        1.5 * (0.05 + alpha + beta * grads * (4 / 3) + alpha + beta * 40 * 3 * (2 / 3) / (1 / 2)), rel=1e-12)


def test_efficiency_falls_with_the_count_for_every_strategy():
    work = sm.Workload(LLAMA, sm.compute_seconds(LLAMA, 8192, sm.H100_BF16_TFLOPS, 0.4), 8192)
    for strategy in sm.STRATEGIES:
        rows = sm.predict(strategy, [8, 16, 64, 512, 4096], work, NET)
        eff = [r.efficiency for r in rows]
        assert eff[0] == 1.0 and all(a >= b for a, b in zip(eff, eff[1:], strict=False)), (strategy, eff)
        assert eff[-1] < 1.0


def test_cpu_ranks_beyond_the_cores_share_them():
    work = sm.Workload(gpt_shape(2, 64, 32, 256), 0.1, 64, "fp32", cpu_cores=2)
    net = ic.Interconnect("cpu", 4, ic.uniform(ic.Link(1e-4, 1e9)), ic.uniform(ic.Link(1e-4, 1e9)))
    assert sm.step_time("ddp", 2, work, net).compute_s == pytest.approx(0.1)
    assert sm.step_time("ddp", 3, work, net).compute_s == pytest.approx(0.15)


def test_frozen_parameters_are_gathered_but_never_reduced():
    # a root and 4 blocks; model.freeze took the root (a tied head: forward and its input's gradient) and blocks 0-1
    # (before the first trained parameter: no gradient reaches them)
    block, front = UnitShape(1e6, 1e6, 2e6, 4e6), UnitShape(1e6, 0, 2e6, 0)
    trained = ModelShape("m", 4.5e6, 1e6, 4, counted=(UnitShape(0.5e6, 0.5e6, 1e6, 2e6),) + (block,) * 4)
    frozen = ModelShape("m", 4.5e6, 1e6, 4, counted=(UnitShape(0.5e6, 0, 1e6, 1e6), front, front, block, block))
    assert frozen.trained_params == 2e6 and trained.trained_params == 4.5e6
    assert frozen.flops_per_token() == 1e6 + 1e6 + 2 * 2e6 + 2 * 6e6
    net, n = flat(ic.Link(1e-6, 10e9)), 4

    def wire(strategy, model):
        return sm.step_time(strategy, n, sm.Workload(model, 1.0, 1, "fp32", log_every=0), net).wire_bytes

    assert wire("ddp", frozen) == pytest.approx(2 * 3 / 4 * 4 * 2e6, rel=1e-12)  # the trained gradients only
    assert wire("zero1", frozen) == pytest.approx(2 * 3 / 4 * 4 * 2e6 + 3 / 4 * 4 * 2e6, rel=1e-12)  # + the updated
    norm = 2 * 3 / 4 * 8  # the sharded gradients' norm
    # every unit gathered for forward; again for backward where its backward runs, or the next unit's does (FSDP2's
    # pre-backward of block 2 prefetches block 1, which has none); reduced: what trains
    assert wire("fsdp", frozen) == pytest.approx(3 / 4 * 4 * ((0.5e6 + 1e6 + 2 * 3 * 1e6) + 2e6) + norm, rel=1e-12)
    assert wire("fsdp", trained) == pytest.approx(3 / 4 * 4 * ((0.5e6 + 4 * 2 * 1e6) + 4.5e6) + norm, rel=1e-12)
    slow = flat(ic.Link(1e-6, 1e8))  # the bytes decide: less to reduce, a shorter step
    for strategy in ("ddp", "zero2", "fsdp"):
        steps = [sm.step_time(strategy, n, sm.Workload(m, 0.01, 1, "fp32"), slow).step_s for m in (frozen, trained)]
        assert steps[0] < steps[1], strategy


def test_ddp_buckets_wait_for_the_backward_of_frozen_blocks_after_the_last_trained_one():
    # the root and block 0 train, block 1 is frozen (its backward passes the input's gradient on: 1 of 8 FLOPs)
    model = ModelShape("m", 3e6, 1e6, 2, counted=(UnitShape(1e6, 1e6, 1, 2), UnitShape(1e6, 1e6, 1, 2),
                                                     UnitShape(1e6, 0, 1, 1)))
    work = sm.Workload(model, 1.0, 1, "fp32", bucket_bytes=2e6, log_every=0)  # 8 MB of gradients: 4 buckets
    step = sm.step_time("ddp", 2, work, flat(ic.Link(0.0, 2e6 / 0.2)))  # 0.2 s per bucket's all-reduce
    # forward 3/8 s; block 1's backward 1/8 s readies nothing; then a bucket every 1/8 s, their all-reduces queued
    ends = [0.5 + k / 8 for k in range(1, 5)]
    comm = 0.0
    for end in ends:
        comm = max(comm, end) + 0.2
    assert step.step_s == pytest.approx(comm, rel=1e-12) and comm == pytest.approx(1.425, rel=1e-12)


def test_uncounted_units_split_compute_as_before():
    units = LLAMA.units()
    assert len(units) == 33 and sum(u.params for u in units) == pytest.approx(LLAMA.params, rel=1e-12)
    assert sum(u.forward_flops + u.backward_flops for u in units) == pytest.approx(LLAMA.flops_per_token(), rel=1e-12)
    assert all(u.backward_flops == 2 * u.forward_flops and u.trained == u.params for u in units)


def test_a_config_s_model_is_counted_from_its_module_tree():
    pytest.importorskip("torch")
    from disttrain.bench.predict_job import counted_shape
    from disttrain.config import ModelConfig
    from disttrain.models import build_model
    from disttrain.perf import flops_per_token

    cfg = ModelConfig(n_layer=3, d_model=96, n_head=4, seq_len=48, vocab_size=300)
    shape, closed = counted_shape(cfg), gpt_shape(3, 96, 48, 300)
    assert (shape.params, shape.layer_params, shape.n_layer) == (closed.params, closed.layer_params, 3)
    assert shape.trained_params == shape.params
    assert shape.flops_per_token() == flops_per_token(build_model(cfg), 48)
    assert shape.flops_per_token() == pytest.approx(closed.flops_per_token(), rel=0.02)  # (+ biases and norms)
    frozen_cfg = replace(cfg, freeze="tok_emb.*,pos_emb.*,blocks.0.*")
    model, frozen = build_model(frozen_cfg), counted_shape(frozen_cfg)
    assert frozen.trained_params == sum(p.numel() for p in model.parameters() if p.requires_grad)
    root, first, second = frozen.units()[:3]
    # ln_f trains (its input gradient and its own: 4 x its 2 x 96), the tied head passes its input gradient back
    assert root.trained == 2 * 96 and root.backward_flops == 2 * 300 * 96 + 4 * 2 * 96
    assert (first.trained, first.backward_flops) == (0, 0) and first.forward_flops > 0  # no gradient reaches block 0
    assert second.trained == second.params and second.backward_flops == 2 * second.forward_flops
    # what freezing saves: the tied head's weight gradient and block 0's whole backward (its parameters' two
    # gradients and its attention's backward)
    saved = 2 * 300 * 96 + 4 * first.params + 8 * 96 * 48
    assert frozen.flops_per_token() == shape.flops_per_token() - saved


def test_shapes_and_flops():
    torch = pytest.importorskip("torch")
    from disttrain.config import ModelConfig
    from disttrain.models.gpt import GPT

    cfg = ModelConfig(n_layer=3, d_model=96, n_head=4, seq_len=48, vocab_size=300)
    model = GPT(cfg)
    shape = gpt_shape(3, 96, 48, 300)
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert shape.layer_params == sum(p.numel() for p in model.blocks[0].parameters())
    assert isinstance(torch.__version__, str)
    assert LLAMA.params == pytest.approx(8.03e9, rel=2e-3)  # Llama 3 8B
    assert LLAMA.flops_per_token() == 6 * LLAMA.matmul_params + 12 * 32 * 4096 * 8192


def test_published_scaling_is_reproduced_within_the_stated_tolerance():
    for case in PUBLISHED:
        rows = case.predicted()
        assert abs(rows[-1].efficiency - case.efficiency) <= case.tolerance, (case.name, rows[-1].efficiency)
    torchtitan = PUBLISHED[0].predicted()
    assert torchtitan[0].tokens_per_s_per_gpu == pytest.approx(5762, rel=0.02)  # MFU 0.34 is the 8-GPU figure


def test_measured_links_from_a_comm_fit():
    fit = {"world_size": 2, "backend": "gloo", "collectives": {
        c: {"alpha_s": 4e-4, "beta_s_per_byte": 1e-9} for c in ("all_reduce", "all_gather", "reduce_scatter")}}
    net = ic.interconnect_from_fit(fit)
    assert net.gpus_per_node == 2
    # the fitted line comes back at the measured world size
    assert ic.collective_time("all_reduce", 1e6, 2, net) == pytest.approx(4e-4 + 1e-9 * 1e6, rel=1e-12)
    assert ic.collective_time("all_gather", 1e6, 2, net) == pytest.approx(4e-4 + 1e-9 * 1e6, rel=1e-12)
    # beyond it: on accelerators alpha is per ring step (all_gather at 3 ranks: 2 hops), on one CPU host per call
    # (gloo's hand-off and wake-ups); the bandwidth term follows the ring's bus factor either way
    # (three ranks on the one machine measured, as `--validate` takes them)
    volume = 1e-9 * 1e6 * (2 / 3) / (1 / 2)
    net = ic.with_gpus_per_node(net, 3)
    assert ic.collective_time("all_gather", 1e6, 3, net) == pytest.approx(2 * 4e-4 + volume, rel=1e-12)
    cpu = ic.with_gpus_per_node(ic.interconnect_from_fit({**fit, "device": "cpu"}), 3)
    assert ic.collective_time("all_gather", 1e6, 2, cpu) == pytest.approx(4e-4 + 1e-9 * 1e6, rel=1e-12)
    assert ic.collective_time("all_gather", 1e6, 3, cpu) == pytest.approx(4e-4 + volume, rel=1e-12)
    assert ic.collective_time("all_reduce", 1e6, 3, cpu) == pytest.approx(4e-4 + 1e-9 * 1e6 * (4 / 3), rel=1e-12)
    # across "nodes" of the measured size the hierarchy runs three phases, and the call costs once: reduce-scatter
    # of 1 MB in the node (1 ms at 0.5 GB/s bus), all-reduce of 0.5 MB across (0.5 ms at 1 GB/s), all-gather (1 ms)
    two_nodes = ic.interconnect_from_fit({**fit, "device": "cpu"})
    assert ic.collective_time("all_reduce", 1e6, 4, two_nodes) == pytest.approx(4e-4 + 2.5e-3, rel=1e-12)
    for bad in (math.nan, -1e-3, "1e-3"):  # a fit's numbers are finite and >= 0, or it is refused
        with pytest.raises(ConfigError, match="all_gather's alpha_s and beta_s_per_byte must be finite numbers >= 0"):
            ic.interconnect_from_fit({**fit, "collectives": {**fit["collectives"], "all_gather": {
                "alpha_s": bad, "beta_s_per_byte": 1e-9}}})
    del fit["collectives"]["reduce_scatter"]
    with pytest.raises(ConfigError, match="reduce_scatter"):
        ic.interconnect_from_fit(fit)


def test_bad_names_are_config_errors():
    assert sm.canonical_strategy("ZeRO3") == "fsdp"
    with pytest.raises(ConfigError, match="choose from ddp"):
        sm.canonical_strategy("tp")
    with pytest.raises(ConfigError, match="--compute-s"):
        sm.compute_seconds(MODELS["resnet50"], 32, 989, 0.4)
    assert math.isfinite(sm.compute_seconds(LLAMA, 8192, 989, 0.4))


def test_hsdp_takes_whole_nodes_beyond_one():
    """Its replicas are nodes: 12 GPUs of 8 per node would be modelled as 8 (one replica); refused in one line."""
    net, work = ic.PRESETS["h100-nvlink+ib-ndr"], sm.Workload(LLAMA, 1.0, 8192, "bf16-mixed", log_every=0)
    assert [p.gpus for p in sm.predict("hsdp", [4, 8, 16], work, net)] == [4, 8, 16]
    with pytest.raises(ConfigError, match="--gpus 12: hsdp shards within a node of 8 devices"):
        sm.predict("hsdp", [8, 12], work, net)
    assert [p.gpus for p in sm.predict("fsdp", [8, 12], work, net)] == [8, 12]  # a partial node is a ring's hop


def test_hsdp_shards_over_its_shard_size_and_all_reduces_across_the_replicas():
    """parallel.hsdp_shard_size: 16 on 8-GPU nodes at 64 GPUs shards over two nodes (a hierarchical reduce-scatter)
    and all-reduces each shard's gradient over 4 replicas, each on another node; 4 puts 2 replicas in a node."""
    net = ic.PRESETS["h100-nvlink+ib-ndr"]
    shape = gpt_shape(2, 64, 32, 256)
    work = sm.Workload(shape, 1.0, 8192, "fp32", log_every=0)
    for shard, per_node in ((16, 1), (4, 2), (0, 1)):  # (0: the interconnect's devices per node, 8)
        units, _, _ = sm._units("hsdp", replace(work, hsdp_shard=shard), 64, net)
        size = shard or 8
        replicas = ic.with_gpus_per_node(net, per_node)
        for unit, u in zip(units, shape.units(), strict=True):
            assert unit.reduce == pytest.approx(ic.collective_time("reduce_scatter", u.trained * 4, size, net)
                                                + ic.collective_time("all_reduce", u.trained * 4 / size, 64 // size,
                                                                     replicas), rel=1e-12)
    assert sm.step_time("hsdp", 64, replace(work, hsdp_shard=64), net) == sm.step_time("fsdp", 64, work, net)
    for counts, shard, says in (([16, 24], 16, "16: it does not divide 24 GPUs"),
                                ([8, 16], 16, "16: it does not divide 8 GPUs"),  # (disttrain refuses it too)
                                ([24], 6, "6: its sharding groups would straddle nodes of 8 devices unevenly")):
        with pytest.raises(ConfigError, match=f"parallel.hsdp_shard_size = {says}"):
            sm.predict("hsdp", counts, replace(work, hsdp_shard=shard), net)


def test_deeper_prefetch_issues_a_later_unit_s_gather_behind_a_long_compute():
    """parallel.fsdp_prefetch = 2: the third block's big all-gather goes out when the first block (a long compute)
    starts, not when the second does; the root, first in forward, prefetches one block (FSDP2's implicit prefetch:
    disttrain sets the blocks' lists only)."""
    unit = timeline.Unit
    units = [unit(0.05, 0.0), unit(0.5, 0.0, gather_fwd=0.01), unit(0.1, 0.0, gather_fwd=0.01),
             unit(0.1, 0.0, gather_fwd=0.3)]
    assert timeline.run_pass(units, 1.0, "forward", "gather_fwd", False, 0.0, 0.0)[0] == pytest.approx(0.55 + 0.3 + 0.1)
    assert timeline.run_pass(units, 1.0, "forward", "gather_fwd", False, 0.0, 0.0, depth=2)[0] == pytest.approx(0.75)
    assert timeline.run_pass(units[:1] + units[2:], 1.0, "forward", "gather_fwd", False, 0.0, 0.0, depth=2)[0] == \
        pytest.approx(0.05 + 0.3 + 0.1)  # (the root issued the first block's gather only: the second's at 0.05)
    # a frozen front: the first trained block's pre-backward gathers the `prefetch` blocks before it, run or not
    block, front = UnitShape(1e6, 1e6, 2e6, 4e6), UnitShape(1e6, 0, 2e6, 0)
    frozen = ModelShape("m", 5e6, 1e6, 4, counted=(UnitShape(1e6, 1e6, 1e6, 2e6), front, front, block, block))
    one, two = (sm.step_time("fsdp", 8, sm.Workload(frozen, 1.0, 1, "fp32", prefetch=d, log_every=0),
                             ic.PRESETS["h100-nvlink+ib-ndr"]) for d in (1, 2))
    assert two.wire_bytes - one.wire_bytes == pytest.approx(1e6 * 4 * ic.bus_factor("all_gather", 8), rel=1e-12)
    net, work = ic.PRESETS["h100-nvlink+ib-ndr"], sm.Workload(LLAMA, 1.0, 8192, "bf16-mixed", log_every=0)
    deep = sm.step_time("fsdp", 1024, replace(work, prefetch=4), net)
    assert deep.step_s <= sm.step_time("fsdp", 1024, work, net).step_s and deep.comm_s == pytest.approx(
        sm.step_time("fsdp", 1024, work, net).comm_s)  # the same collectives, issued earlier


def test_a_tensor_split_runs_the_strategy_over_its_groups_on_a_share_of_the_model():
    """tensor = 2 on 64 GPUs: the strategy runs over 32 ranks two apart, each with half of every unit: as 32 ranks of
    half the model where a node holds 4 of them (its network shared by the 2 groups a node holds); ddp's data axis
    as FSDP2's replicate (each unit's gradients all-reduced, no buckets: DDP cannot hold DTensors)."""
    work = sm.Workload(LLAMA, 1.0, 8192, "bf16-mixed", log_every=0)
    for strategy in ("ddp", "fsdp"):
        split = sm.step_time(strategy, 64, replace(work, tensor=2), NET)
        alone = sm.step_time(strategy, 32, replace(work, model=split_shape(LLAMA, 2)), ic.with_gpus_per_node(NET, 4),
                             model_split=True)
        assert (split.step_s, split.comm_s, split.wire_bytes) == pytest.approx(
            (alone.step_s, alone.comm_s, alone.wire_bytes), rel=1e-12)
    half = split_shape(LLAMA, 2)
    assert (half.params, half.trained_params) == pytest.approx((LLAMA.params / 2, LLAMA.trained_params / 2))
    assert [u.forward_flops for u in half.units()] == [u.forward_flops for u in LLAMA.units()]  # (the shares kept)


def test_ddp_under_a_model_split_all_reduces_each_unit_as_fsdp2_s_replicate_does():
    """Each unit's trained gradients all-reduced in FSDP's reduce dtype (fp32 under bf16-mixed), nothing gathered:
    the bytes of a plain all-reduce of the gradients, in one call per unit rather than per 25 MiB bucket."""
    work = sm.Workload(LLAMA, 1.0, 8192, "bf16-mixed", log_every=0)
    replicate = sm.step_time("ddp", 64, work, NET, model_split=True)
    assert replicate.wire_bytes == pytest.approx(LLAMA.trained_params * 4 * ic.bus_factor("all_reduce", 64), rel=1e-9)
    units = sm._units("ddp", work, 64, NET, replicated=True)[0]
    assert len(units) == 1 + LLAMA.n_layer and all(u.gather_fwd == u.gather_bwd == 0 for u in units)


def test_a_tensor_split_s_collectives_hold_up_the_compute():
    """A tensor group alone (8 GPUs, tensor = 8): the step is its compute plus every collective of each micro-batch,
    and once those of the step; with data parallelism around it they add to the step too, less what of the data
    collectives the longer compute now hides."""
    calls = (("forward", "all_reduce", 64e6, "bfloat16"), ("backward", "all_gather", 32e6, "float32"),
             ("backward", "reduce_scatter", 32e6, "float32"), ("step", "all_reduce", 1e3, "float32"))
    work = sm.Workload(LLAMA, 0.5, 1024, "bf16-mixed", micro_steps=2, log_every=0, tensor=8, tensor_calls=calls)
    group = sm.step_time("fsdp", 8, work, NET)

    def seconds(part):
        return sum(ic.collective_time(c, b, 8, NET) for p, c, b, _ in calls if p == part)

    tensor = 2 * (seconds("forward") + seconds("backward")) + seconds("step")
    assert group.step_s == pytest.approx(0.5 + tensor, rel=1e-12) and group.comm_s == pytest.approx(tensor)
    assert group.wire_bytes == pytest.approx(2 * (64e6 * 2 * 7 / 8 + 64e6 * 7 / 8) + 1e3 * 2 * 7 / 8, rel=1e-12)
    for strategy in ("ddp", "fsdp"):
        quiet = sm.step_time(strategy, 64, replace(work, tensor_calls=()), NET)
        loud = sm.step_time(strategy, 64, work, NET)
        assert quiet.step_s < loud.step_s <= quiet.step_s + tensor + 1e-12
        assert loud.comm_s == pytest.approx(quiet.comm_s + tensor, rel=1e-12)


def test_the_step_s_tensor_split_calls_go_out_together_and_pay_one_call_s_cost():
    """The clip's norm and the optimizer sum the partial gradients with DTensor's functional collectives, issued
    together and waited once: on a CPU host's links (a cost per call) the run pays that cost once, the other calls
    their bytes; each micro-batch's calls, waited one by one, pay it each."""
    fit = {"world_size": 2, "backend": "gloo", "device": "cpu", "collectives": {
        c: {"alpha_s": 1e-3, "beta_s_per_byte": 1e-9} for c in ("all_reduce", "all_gather", "reduce_scatter")}}
    net = ic.interconnect_from_fit(fit)
    work = sm.Workload(gpt_shape(2, 64, 32, 256), 0.1, 1, "fp32", log_every=0, tensor=2, cpu_cores=2)

    def step(*calls):
        return sm.step_time("ddp", 2, replace(work, tensor_calls=calls), net).step_s

    run = [("step", "all_reduce", 1e4, "float32")] * 3
    assert step(*run) - step() == pytest.approx(1e-3 + 3 * 1e-9 * 1e4, rel=1e-9)
    apart = [("backward", "all_reduce", 1e4, "float32")] * 3
    assert step(*apart) - step() == pytest.approx(3 * (1e-3 + 1e-9 * 1e4), rel=1e-9)


@pytest.mark.parametrize("strategy, change, gpus, says", [
    ("ddp", dict(tensor=3), [8], "--gpus 8: a group of parallel.tensor x parallel.pipeline x parallel.context = 3 "
     "GPUs"),
    ("ddp", dict(tensor=3), [24], "parallel.tensor = 3: its groups would straddle nodes of 8 devices"),
    ("ddp", dict(tensor=16), [16], "parallel.tensor = 16: its groups would straddle nodes of 8 devices"),
    ("ddp", dict(tensor=2, grad_compression="powersgd"), [8], "parallel.grad_compression = 'powersgd' with "
     "parallel.tensor = 2 does not run in disttrain"),
    ("hsdp", dict(tensor=2), [16], "hsdp with parallel.tensor = 2 is not modelled"),
    ("zero1", dict(tensor=2), [16], "zero1 with parallel.tensor = 2 does not run in disttrain"),
])
def test_what_a_tensor_split_does_not_price_is_refused(strategy, change, gpus, says):
    with pytest.raises(ConfigError, match=says):
        sm.predict(strategy, gpus, replace(sm.Workload(LLAMA, 1.0, 8192), **change), NET)


def test_a_tensor_split_s_logged_line_gathers_over_every_gpu():
    """The figures' all-gather on a logged line spans all 64 GPUs on the links as they are (not a data group's)."""
    work = sm.Workload(LLAMA, 1.0, 8192, "bf16-mixed", tensor=2)
    every, none = (sm.step_time("fsdp", 64, replace(work, log_every=k), NET) for k in (1, 0))
    assert every.step_s - none.step_s == pytest.approx(ic.collective_time("all_gather", 40 * 64, 64, NET), rel=1e-9)


def _stage(flops: float, params: float = 1e6) -> ModelShape:
    return ModelShape("stage", params, counted=(UnitShape(0.0, 0.0, 0.0, 0.0), UnitShape(params, params, flops / 3,
                                                                                          2 * flops / 3)))


def _pipeline(stages: int, m: int, flops: float = 1.0, **fields) -> sm.Workload:
    """A pipeline of 4 ranks over `stages` equal stages, 0.8 s of compute a GPU (its equal share), no data axis."""
    parts = tuple(_stage(flops) for _ in range(stages))
    whole = sum(s.flops_per_token() for s in parts)
    model = ModelShape("m", 4e6, counted=(UnitShape(0.0, 0.0, 0.0, 0.0), UnitShape(4e6, 4e6, whole / 3, 2 * whole / 3)))
    return sm.Workload(model, 0.8, 1, "fp32", micro_steps=m, log_every=0, pipeline=4, stages=parts, **fields)


def _orders(schedule: str, ranks: int, m: int, v: int) -> tuple:
    from disttrain.parallel.placement import torch_order

    return tuple(tuple(torch_order(schedule, ranks, r, m, v)) for r in range(ranks))


def test_a_pipeline_plays_its_schedule_s_bubble():
    """p = 4 ranks, m = 8 micro-batches, one GPU each, equal stages, sends free: gpipe and 1f1b take (m + p - 1)
    micro-batches of a stage; v stages a rank interleaved (torch's own order, played) (m + (p - 1) / v); the
    zero-bubble schedules, whose weight gradients fill the bubble, less; a first stage twice as heavy sets the
    steady state (and hides most of the others' fill and drain)."""
    micro = 0.8 / 8  # (compute_s: a GPU's share of equal stages)
    for schedule in ("gpipe", "1f1b"):
        work = _pipeline(4, 8, schedule=schedule)
        assert sm.step_time("ddp", 4, work, NET).step_s == pytest.approx((8 + 3) * micro, rel=1e-9)
        assert sm.step_time("ddp", 1, work, NET).step_s == pytest.approx(4 * 0.8)  # (the stages on one device)
    for v in (2, 4):
        work = _pipeline(4 * v, 8, schedule="interleaved-1f1b", virtual=v, orders=_orders("interleaved-1f1b", 4, 8, v))
        assert sm.step_time("ddp", 4, work, NET).step_s == pytest.approx((8 + 3 / v) * micro, rel=1e-9)
    for schedule in ("zero-bubble", "zbv"):
        work = _pipeline(8, 8, schedule=schedule, orders=_orders(schedule, 4, 8, 2))
        assert 8 * micro < sm.step_time("ddp", 4, work, NET).step_s < (8 + 3 / 2) * micro
    slow = _pipeline(4, 8)
    slow = replace(slow, stages=(_stage(2.0), *slow.stages[1:]), model=replace(slow.model, counted=(
        slow.model.counted[0], UnitShape(4e6, 4e6, 5 / 3, 10 / 3))))  # the first stage does 2 of 5 shares
    heavy, light = 0.8 * 4 * 2 / 5 / 8, 0.8 * 4 / 5 / 8  # (a micro-batch's forward and backward on each)
    # 1f1b: the first rank's micro-batches back to back, but for the wait of its first backward, which comes back
    # from the 3 light stages' round trip while it runs its 3 warm-up forwards (a third of a heavy micro-batch each)
    assert sm.step_time("ddp", 4, slow, NET).step_s == pytest.approx(8 * heavy + 3 * light - 3 * heavy / 3, rel=1e-9)


def test_a_pipeline_s_sends_delay_what_waits_for_them():
    """The sends fill and drain the pipeline: at least 2 (p v - 1) on the path, and the steady state's where a rank
    waits for one (1f1b's alternation does: a backward waits for the next stage's), at most two a micro-batch."""
    send = ic.collective_time("all_gather", 2e6, 2, NET)
    for v, schedule in ((1, "1f1b"), (2, "interleaved-1f1b")):
        orders = _orders(schedule, 4, 8, v) if v > 1 else ()
        quiet, sending = (sm.step_time("ddp", 4, _pipeline(4 * v, 8, schedule=schedule, orders=orders,
                                                           send_bytes=nbytes), NET).step_s for nbytes in (0.0, 1e6))
        assert 2 * (4 * v - 1) * send <= sending - quiet <= 2 * (4 * v - 1 + 8 * v) * send


def test_a_pipeline_s_stages_run_their_strategy_over_the_gpus_of_a_stage():
    """64 GPUs, p = 2: each stage's data-parallel collectives over 32 GPUs on its own parameters, as that stage
    alone (ddp's as FSDP2's replicate); the step adds the bubble to the slowest stage's."""
    stages = (_stage(1.0, 2e9), _stage(1.0, 1e9))
    model = ModelShape("m", 3e9, counted=(UnitShape(0.0, 0.0, 0.0, 0.0), UnitShape(3e9, 3e9, 2 / 3, 4 / 3)))
    work = sm.Workload(model, 1.0, 1, "bf16-mixed", micro_steps=4, log_every=0, pipeline=2, stages=stages)
    for strategy in ("ddp", "fsdp"):
        alone = [sm.step_time(strategy, 32, replace(work, model=st, compute_s=1.0, pipeline=1, stages=()), NET,
                              model_split=True, pipelined=True) for st in stages]
        step = sm.step_time(strategy, 64, work, NET)
        assert step.step_s == pytest.approx(max(a.step_s for a in alone) + 1.0 / 4, rel=1e-9)
        assert step.wire_bytes == pytest.approx(max(a.wire_bytes for a in alone), rel=1e-9)


def test_a_pipeline_s_tensor_split_runs_each_rank_s_own_calls_and_the_bubble_waits_for_them():
    """p = 2 stages, each split over t = 4 GPUs of a node, 32 GPUs: each rank's step is its stage's under the tensor
    split, with its own calls (the last stage's more: the logits gathered); the bubble is the other rank's
    micro-batch, its compute and its split's calls."""
    stages = (_stage(1.0, 2e9), _stage(1.0, 2e9))
    model = ModelShape("m", 4e9, counted=(UnitShape(0.0, 0.0, 0.0, 0.0), UnitShape(4e9, 4e9, 2 / 3, 4 / 3)))
    light = (("forward", "all_reduce", 4e6, "bfloat16"), ("backward", "all_reduce", 4e6, "bfloat16"))
    heavy = (*light, ("forward", "all_gather", 6e8, "bfloat16"))
    work = sm.Workload(model, 1.0, 1, "bf16-mixed", micro_steps=4, log_every=0, pipeline=2, stages=stages, tensor=4,
                       stage_calls=(light, heavy), step_calls=((), ()))
    own = [replace(work, model=st, compute_s=1.0, pipeline=1, stages=(), stage_calls=(), tensor_calls=calls)
           for st, calls in zip(stages, (light, heavy), strict=True)]
    alone = [sm.step_time("fsdp", 16, w, NET, model_split=True, pipelined=True) for w in own]
    split = [sum(ic.collective_time(c, b, 4, NET.for_dtype(d, c)) for _, c, b, d in calls) for calls in (light, heavy)]
    step = sm.step_time("fsdp", 32, work, NET)
    assert alone[1].step_s > alone[0].step_s  # (the gathered logits hold up the last stage)
    assert step.step_s == pytest.approx(alone[1].step_s + 1.0 / 4 + split[0], rel=1e-9)
    assert sm.step_time("fsdp", 32, replace(work, stage_calls=((), ())), NET).step_s < step.step_s - 4 * split[1]


def test_a_pipeline_s_sends_cross_nodes_once_the_job_does_and_its_tied_weight_is_summed():
    """The sends between stages inside a node at 8 GPUs, over the network at 16 (a boundary between nodes); a tied
    embedding and head summed between the first and last stage after the last backward; on a CPU host every send a
    call on each rank's timeline, 2 v a micro-batch."""
    stages = (_stage(1.0), _stage(1.0))
    model = ModelShape("m", 2e6, counted=(UnitShape(0.0, 0.0, 0.0, 0.0), UnitShape(2e6, 2e6, 2 / 3, 4 / 3)))
    work = sm.Workload(model, 1.0, 1, "fp32", micro_steps=4, log_every=0, pipeline=2, stages=stages, send_bytes=1e7)
    quiet = replace(work, send_bytes=0.0)
    inside, across = ic.collective_time("all_gather", 2e7, 2, NET), ic.collective_time(
        "all_gather", 2e7, 2, replace(NET, gpus_per_node=1))
    assert across > inside
    added = {n: sm.step_time("ddp", n, work, NET).step_s - sm.step_time("ddp", n, quiet, NET).step_s for n in (8, 16)}
    assert added[16] / added[8] == pytest.approx(across / inside, rel=1e-9)  # (the same hops on the path, slower)
    assert added[8] == pytest.approx(4 * inside, rel=1e-9)  # (fill, drain, and 2 round trips in the steady state)
    tied = sm.step_time("ddp", 2, replace(quiet, tied_bytes=4e6), NET)
    assert tied.step_s - sm.step_time("ddp", 2, quiet, NET).step_s == pytest.approx(
        ic.collective_time("all_reduce", 4e6, 2, NET), rel=1e-9) and tied.wire_bytes == 4e6
    fit = {"world_size": 2, "backend": "gloo", "device": "cpu", "collectives": {
        c: {"alpha_s": 1e-3, "beta_s_per_byte": 1e-9} for c in ("all_reduce", "all_gather", "reduce_scatter")}}
    cpu = ic.interconnect_from_fit(fit)
    call = ic.collective_time("all_gather", 2e7, 2, cpu)
    on_cpu = replace(work, cpu_cores=2)
    assert sm.step_time("ddp", 2, on_cpu, cpu).step_s == pytest.approx(1.0 + 2 * 4 * call + (1.0 + 2 * 4 * call) / 4,
                                                                       rel=1e-9)  # each rank: 4 micro-batches


@pytest.mark.parametrize("strategy, change, n, says", [
    ("fsdp", dict(schedule="gpipe", virtual=2), 8, "pipeline_stages_per_rank = 2: parallel.pipeline_schedule = "
     "'gpipe' runs 1 a rank"),
    ("fsdp", dict(schedule="interleaved-1f1b", virtual=1), 8, "'interleaved-1f1b' runs 2 or more a rank"),
    ("fsdp", dict(schedule="dualpipev", micro_steps=3), 8, "'dualpipev' runs at least 2 x parallel.pipeline = 4 "
     "micro-batches a step, not 3"),
    ("fsdp", dict(schedule="dualpipe"), 8, "'dualpipe' is not modelled; predict gpipe, 1f1b, interleaved-1f1b, "
     "zero-bubble, zbv, dualpipev"),
    ("fsdp", dict(tensor=2, cpu_cores=2, stage_calls=((), ()), step_calls=((), ())), 4, "a tensor or context split "
     "or data parallelism beside it"),
    ("hsdp", {}, 16, "hsdp with parallel.pipeline = 2 is not modelled"),
    ("zero1", {}, 8, "zero1 with parallel.pipeline = 2 does not run in disttrain"),
    ("fsdp", dict(cpu_cores=2), 4, "parallel.pipeline = 2 on 4 ranks of a CPU host with 2 cores is not modelled"),
    ("fsdp", dict(cpu_cores=1), 2, "parallel.pipeline = 2 on 2 ranks of a CPU host with 1 cores is not modelled"),
    ("fsdp", dict(schedule="interleaved-1f1b", micro_steps=3), 8, "runs micro-batches in multiples of "
     "parallel.pipeline = 2, not 3"),
])
def test_what_a_pipeline_does_not_price_is_refused(strategy, change, n, says):
    work = sm.Workload(LLAMA, 1.0, 1, pipeline=2, stages=(LLAMA, LLAMA), **change)
    with pytest.raises(ConfigError, match=says):
        sm.step_time(strategy, n, work, NET)


def test_the_model_imports_no_torch():
    code = ("import sys, disttrain.bench.scale_model, disttrain.bench.published_scaling; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_the_timeline_plays_a_split_backward_and_names_orders_that_wait_for_ever():
    """A split backward: its input part carries the tensor split's backward calls, its weight part only compute
    (what fills a zero-bubble schedule's bubble); a full backward counts as both parts of its micro-batch; an order
    whose computation waits for an input that never comes is one line naming it."""
    from disttrain.bench.pipeline_timeline import StageCost, play

    cost = StageCost(forward=1.0, backward=2.0, backward_calls=0.5)
    assert (cost.of("F"), cost.of("B"), cost.of("I"), cost.of("W")) == (1.0, 2.5, 1.5, 1.0)
    one = (((0, "F"), (0, "I"), (0, "F"), (0, "B"), (0, "W")),)  # (micro-batch 1's full backward, then 0's weights)
    assert play(one, lambda s: 0, (cost,), 0.0) == [1.0 + 1.5 + 1.0 + 2.5 + 1.0]
    two = (((0, "F"), (0, "B")), ((1, "B"), (1, "F")))  # (the last stage's backward before its forward)
    with pytest.raises(ValueError, match=r"\(1, \(1, 'B'\)\)"):
        play(two, lambda s: s, (cost, cost), 0.0)


def test_a_pipeline_stage_s_fsdp_gathers_once_a_step_and_again_for_each_backward():
    """torch's pipeline stage keeps FSDP's parameters gathered after a backward until the step: a stage's zero2
    gathers each unit once a step; fsdp, which reshards after forward (its root too, under a pipeline), once and
    again for each of the m micro-batches' backward: m more gathers of every unit, the root included."""
    model = ModelShape("m", 5e6, counted=(UnitShape(1e6, 1e6, 1 / 3, 2 / 3),) * 5)  # (the root, then 4 blocks)
    work = sm.Workload(model, 1.0, 1, "fp32", micro_steps=4, log_every=0)
    sent = {s: sm.step_time(s, 4, work, NET, pipelined=True).wire_bytes for s in ("zero2", "fsdp")}
    gather = 4 * ic.bus_factor("all_gather", 4)  # (fp32 bytes of one parameter, as each rank sends them)
    assert sent["fsdp"] - sent["zero2"] == pytest.approx(5e6 * gather * 4, rel=1e-9)
    alone = {s: sm.step_time(s, 4, work, NET).wire_bytes for s in ("zero2", "fsdp")}  # (no pipeline: every pass)
    assert alone["zero2"] - sent["zero2"] == pytest.approx(5e6 * gather * 3, rel=1e-9)


def test_a_v_shaped_pipeline_holds_both_ends_on_one_rank():
    """zbv puts the first and the last stage on rank 0: a tied embedding and head are summed there, with no
    collective; and it takes any count of micro-batches (the looped schedules want multiples of p)."""
    work = _pipeline(8, 6, schedule="zbv", orders=_orders("zbv", 4, 6, 2))
    tied = replace(work, tied_bytes=4e6)
    assert sm.step_time("ddp", 4, tied, NET).step_s == sm.step_time("ddp", 4, work, NET).step_s
    looped = _pipeline(8, 6, schedule="interleaved-1f1b", orders=_orders("interleaved-1f1b", 4, 8, 2))
    with pytest.raises(ConfigError, match="runs micro-batches in multiples of parallel.pipeline = 4, not 6"):
        sm.step_time("ddp", 4, looped, NET)


def test_a_split_backward_s_first_stage_runs_its_whole_backward_as_the_weight_part():
    """torch's split-backward schedules skip the first stage's input part (its input, token ids, has no gradient)
    and run its whole backward as the weight part; the other stages split it in halves."""
    work = _pipeline(8, 8, schedule="zero-bubble", orders=_orders("zero-bubble", 4, 8, 2))
    _, costs = sm._stage_costs(work, NET)
    assert costs[0].split == (0.0, costs[0].backward) and costs[0].of("I") == 0.0
    assert all(c.split == () and c.of("I") == c.of("W") == c.backward / 2 for c in costs[1:])
    _, looped = sm._stage_costs(replace(work, schedule="interleaved-1f1b"), NET)
    assert looped[0].split == ()


def test_a_context_split_runs_the_strategy_over_every_gpu_and_its_calls_hold_up_the_compute():
    """parallel.context = 2 on 16 GPUs: each rank holds the whole model, and the strategy runs over all 16 (context
    ranks join the data axis; ddp as FSDP2's replicate); without calls that is a model split's data axis of 16. Its
    calls (each attention's keys and values, and their gradients) add to the step what they take over the 2 ranks
    of a group, once each micro-batch."""
    from disttrain.bench.model_split import context_calls

    calls = context_calls(LLAMA, "bfloat16")
    assert len(calls) == 4 * LLAMA.n_layer and LLAMA.kv_width == 4096 // 4
    work = sm.Workload(LLAMA, 1.0, 4096, "bf16-mixed", micro_steps=2, log_every=0, context=2)
    for strategy in ("ddp", "fsdp"):
        quiet = sm.step_time(strategy, 16, work, NET)
        assert (quiet.step_s, quiet.wire_bytes) == pytest.approx(
            (lambda s: (s.step_s, s.wire_bytes))(sm.step_time(strategy, 16, replace(work, context=1), NET,
                                                              model_split=True)), rel=1e-12)
        loud = sm.step_time(strategy, 16, replace(work, context_calls=calls), NET)
        held = 2 * sum(ic.collective_time(c, b, 2, NET.for_dtype(d, c)) for _, c, b, d in calls)
        assert loud.comm_s == pytest.approx(quiet.comm_s + held, rel=1e-9)
        assert quiet.step_s < loud.step_s <= quiet.step_s + held + 1e-12
    recomputed = context_calls(LLAMA, "bfloat16", recompute=True)  # (activation checkpointing: gathered again)
    assert len(recomputed) == 6 * LLAMA.n_layer
    gathered = [c for c in recomputed if c[1] == "all_gather"]
    assert {c[2] for c in gathered} == {LLAMA.seq_len * 1024 * 2} and len(gathered) == 4 * LLAMA.n_layer


@pytest.mark.parametrize("change, gpus, says", [
    (dict(context=3), [8], "a group of parallel.tensor x parallel.pipeline x parallel.context = 3 GPUs"),
    (dict(context=16), [16], "parallel.context = 16: its groups would straddle nodes of 8 devices"),
    (dict(context=4, tensor=4), [16], "parallel.tensor x parallel.context = 16: its groups would straddle nodes of 8"),
    (dict(context=2, model=MODELS["resnet50"]), [8], "resnet50 has no attention the model knows of"),
    (dict(context=2, grad_compression="powersgd"), [8], "'powersgd' with parallel.context = 2 does not run"),
    (dict(context=2, pipeline=2, tensor=2, stages=(LLAMA, LLAMA)), [8], "parallel.context = 2 with "
     "parallel.pipeline and parallel.tensor together does not run in disttrain"),
])
def test_what_a_context_split_does_not_price_is_refused(change, gpus, says):
    with pytest.raises(ConfigError, match=says):
        sm.predict("ddp", gpus, replace(sm.Workload(LLAMA, 1.0, 8192), **change), NET)
    with pytest.raises(ConfigError, match="hsdp with parallel.context = 2 is not modelled"):
        sm.predict("hsdp", [16], replace(sm.Workload(LLAMA, 1.0, 8192), context=2), NET)


def test_a_pipeline_of_context_splits_runs_each_stage_s_blocks_calls_and_the_bubble_waits_for_them():
    """p = 2 stages of 5 and 1 of 6 equal blocks, each stage's sequence cut over c = 2 GPUs, 32 GPUs: each rank's step
    is its stage's under the context split with its own blocks' calls (5 of the 6 blocks' on the first stage), over
    the 16 GPUs of its stage (context ranks in the data axis); the first rank, whose forwards outlast the other
    stage's round trip, runs without a wait, so the pipeline's step is its step; the sends carry a rank's pieces."""
    from disttrain.bench.model_split import context_calls, stage_context_calls

    blocks = [UnitShape(1e9, 1e9, 1 / 3, 2 / 3)] * 6
    model = replace(joined("m", [], blocks, 8192), kv_width=1024)
    stages = (joined("s0", [], blocks[:5], 8192), joined("s1", [], blocks[5:], 8192))
    calls = context_calls(model, "bfloat16")
    work = sm.Workload(model, 1.0, 1, "bf16-mixed", micro_steps=4, log_every=0, pipeline=2, stages=stages,
                       context=2, context_calls=calls)
    own = [stage_context_calls(work, stage) for stage in stages]
    assert (len(own[0]), len(own[1])) == (5 * 4, 4) and own[0] + own[1] == calls  # (4 calls a block)
    alone = [sm.step_time("fsdp", 16, replace(work, model=replace(st, kv_width=1024),
                                              compute_s=2 * st.flops_per_token() / 6, pipeline=1, stages=(),
                                              context_calls=mine), NET, model_split=True, pipelined=True)
             for st, mine in zip(stages, own, strict=True)]
    step = sm.step_time("fsdp", 32, work, NET)
    assert step.step_s == pytest.approx(alone[0].step_s, rel=1e-9)
    held = sum(ic.collective_time(c, b, 2, NET.for_dtype(d, c)) for _, c, b, d in own[0])
    quiet = sm.step_time("fsdp", 32, replace(work, context_calls=()), NET)
    assert step.step_s - quiet.step_s == pytest.approx(4 * held, rel=1e-9)  # (each micro-batch's, on the first rank)
    with pytest.raises(ConfigError, match="parallel.context = 16: its groups would straddle nodes of 8 devices"):
        sm.step_time("fsdp", 32, replace(work, context=16), NET)


def test_the_first_stage_s_full_backward_carries_its_split_calls_under_dualpipev():
    """dualpipev runs the first stage's backward whole (its overlapped pairs' "B") as well as split (I, W): both carry
    the tensor split's backward calls, as the weight part does under zbv (the first stage's input has no gradient)."""
    calls = ((("backward", "all_reduce", 1e6, "float32"),),) * 4
    work = sm.Workload(LLAMA, 1.0, 1, "fp32", 4, tensor=2, pipeline=2, schedule="dualpipev", stages=(LLAMA,) * 4,
                       stage_calls=calls, step_calls=((), ()))
    _, costs = sm._stage_costs(work, NET)
    first, inner = costs[0], costs[1]
    assert first.of("B") == pytest.approx(first.of("I") + first.of("W")) == pytest.approx(first.whole() - first.forward)
    assert first.of("B") - inner.of("B") == pytest.approx(0.0, abs=1e-12)  # (the same stage, calls included)
