"""The cost of scale as arithmetic: the step time of each data-parallel strategy, with a tensor split, a pipeline or
a context split around it, from one device's compute time and its collectives, timed on an interconnect's
alpha-beta links (interconnect.py). Pure Python (no torch), so `disttrain bench predict` and the tests share one
formula for everything.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from disttrain.bench.buckets import bucket_calls, bucket_units, waits_behind_backward
from disttrain.bench.interconnect import ITEMSIZE, Interconnect, bus_factor, collective_time
from disttrain.bench.model_shapes import ModelShape, joined
from disttrain.bench.model_split import (
    check_context,
    check_pipeline,
    check_tensor,
    rank_context_calls,
    split_seconds,
    split_shape,
    stage_context_calls,
)
from disttrain.bench.pipeline_timeline import StageCost, one_stage_order, play
from disttrain.bench.timeline import Step, Unit, run_pass
from disttrain.errors import ConfigError
from disttrain.parallel import mesh

# --- workloads ------------------------------------------------------------------------------------------------

WIRE_DTYPES: dict[str, tuple[str, str, str]] = {  # (stored parameters and DDP gradients, FSDP gather, FSDP reduce)
    "fp32": ("float32",) * 3, "bf16-mixed": ("float32", "bfloat16", "float32"),
    "fp16-mixed": ("float32", "float16", "float32"), "bf16-true": ("bfloat16",) * 3}
"""Element types on the wire under each precision (precision.py: FSDP gathers in the compute dtype and reduces in
fp32; DDP and ZeRO-1 move the stored parameters' dtype). `Workload.grad_compression` fp16 / bf16 makes the
reductions 2 bytes (DDP's hook, FSDP's reduce dtype): `reduced_dtype`. Each collective's bytes are priced with the
links of its element type where the interconnect has them (`Interconnect.for_dtype`)."""

BYTES: dict[str, tuple[int, ...]] = {name: tuple(ITEMSIZE[d] for d in dtypes) for name, dtypes in WIRE_DTYPES.items()}
"""Bytes per element of `WIRE_DTYPES`."""

COMPRESSED = {"fp16": "float16", "bf16": "bfloat16"}
"""`parallel.grad_compression` values that reduce gradients in 2 bytes an element, and that element type."""


def reduced_dtype(precision: str, grad_compression: str = "none") -> str:
    """Element type of a gradient reduction under FSDP (DDP's too where compressed)."""
    return COMPRESSED.get(grad_compression, WIRE_DTYPES[precision][2])


def reduced_bytes(precision: str, grad_compression: str = "none") -> int:
    """Bytes per element of a gradient reduction under FSDP (DDP's too where compressed)."""
    return ITEMSIZE[reduced_dtype(precision, grad_compression)]


@dataclass(frozen=True)
class Workload:
    model: ModelShape
    compute_s: float
    """Forward + backward + optimizer of one step on one device, alone (no communication)."""
    tokens: float
    """Tokens (or samples) per device per step."""
    precision: str = "bf16-mixed"
    micro_steps: int = 1
    """Accumulation micro-batches per step; gradients are reduced on the last one only."""
    bucket_bytes: float = 25 * 2**20
    """DDP's bucket size (`parallel.bucket_cap_mb`), in the gradients' stored dtype."""
    grad_compression: str = "none"
    """`parallel.grad_compression`: fp16 / bf16 send DDP's buckets and FSDP's reduce-scatters in 2 bytes an element;
    powersgd sends DDP's buckets as low-rank factors (`buckets.bucket_calls`)."""
    powersgd_rank: int = 1
    """`parallel.powersgd_rank`: the factors' rank under powersgd."""
    prefetch: int = 1
    """All-gathers a sharded strategy issues ahead of the unit running (`parallel.fsdp_prefetch`; FSDP2's implicit
    prefetch is one)."""
    hsdp_shard: int = 0
    """hsdp's ranks per sharding group (`parallel.hsdp_shard_size`); 0: the interconnect's devices per node (shard
    within a node, replicate across)."""
    cpu_cores: int = 0
    """0 on accelerators. On CPU, ranks beyond the cores share them, and so do gloo's communication threads."""
    log_every: int = 10
    """Steps per logged line (`train.log_every`, 10 by default; 0 = none): each line all-gathers the ranks' figures
    (perf.rank_summary: 5 float64 per rank) and waits for it."""
    tensor: int = 1
    """Ranks each block is split over (`parallel.tensor`), neighbours within a node: the strategy runs over GPUs /
    tensor ranks, each holding 1/tensor of every unit, and `compute_s` and `tokens` are one of those ranks' shares."""
    pipeline: int = 1
    """Pipeline ranks a model's stages are split over (`parallel.pipeline`), the outermost axis: a group of pipeline x
    tensor GPUs reads one batch in `micro_steps` micro-batches; `compute_s` and `tokens` stay one GPU's share of
    the whole model's (as if the stages were equal); `stages` says who holds what."""
    schedule: str = "1f1b"
    """`parallel.pipeline_schedule`: gpipe and 1f1b (one stage per rank), interleaved-1f1b and zero-bubble (two
    per rank, or `virtual`), zbv (two, in a V)."""
    virtual: int = 0
    """Stages each pipeline rank runs (`parallel.pipeline_stages_per_rank`); 0: the schedule's
    (`mesh.stages_per_rank`)."""
    stages: tuple[ModelShape, ...] = ()
    """Under a pipeline, what each stage holds, in stage order (its units; the embedding's parameters on the
    first, the head's and its FLOPs on the last): `predict_job.pipeline_stages`, disttrain's own split."""
    orders: tuple[tuple[tuple[int, str], ...], ...] = ()
    """Under a pipeline of several stages a rank, each rank's computations in the order torch's schedule runs
    them (`pipeline_timeline`; `predict_job.pipeline_orders`); () for gpipe and 1f1b, written by the timeline."""
    send_bytes: float = 0.0
    """Under a pipeline, bytes of one micro-batch's activations crossing a stage boundary (their gradients come back
    as many)."""
    tied_bytes: float = 0.0
    """Under a pipeline, bytes of a weight the first and last stage both hold (a tied embedding and head), whose
    gradients they sum every step."""
    tensor_calls: tuple[tuple[str, str, float, str], ...] = ()
    """(part, collective, bytes, dtype) of each collective the tensor split sends in one micro-batch's forward or
    backward, or once in the step after them (part "step": the clip's norm, partial gradients summed)
    (`bench/tensor_calls.count`, or `model_shapes.tensor_calls` for a preset); each holds up the compute."""
    stage_calls: tuple[tuple[tuple[str, str, float, str], ...], ...] = ()
    """Under a pipeline with a tensor split, each stage's forward and backward `tensor_calls`
    (`predict_job.stage_calls_of`)."""
    step_calls: tuple[tuple[tuple[str, str, float, str], ...], ...] = ()
    """... and each pipeline rank's step calls, over its stages' gradients together."""
    context: int = 1
    """Ranks each sequence is cut over (`parallel.context`), neighbours within a node, each computing its share of
    the tokens (and of the causal query-key pairs: parallel/context.py balances them): the strategy runs over every
    GPU (context ranks join the data axis, each holding the whole model), and `compute_s` and `tokens` are a rank's
    share."""
    context_calls: tuple[tuple[str, str, float, str], ...] = ()
    """(part, collective, bytes, dtype) of each collective the context split sends in one micro-batch's forward or
    backward (`model_split.context_calls`: each attention's keys and values); each holds up the compute."""


STRATEGIES = ("ddp", "zero1", "zero2", "fsdp", "hsdp")
ALIASES = {"zero3": "fsdp"}


def canonical_strategy(name: str) -> str:
    name = ALIASES.get(name.strip().lower(), name.strip().lower())
    if name not in STRATEGIES:
        raise ConfigError(f"--strategy {name!r} is not modelled; choose from {', '.join(STRATEGIES)} (zero3 = fsdp)")
    return name



# --- one step under each strategy ----------------------------------------------------------------------------


def _units(strategy: str, work: Workload, n: int, net: Interconnect, spread: int = 1, replicated: bool = False,
           pipelined: bool = False) -> tuple[list[Unit], float, float]:
    """(units in forward order, seconds of collectives after backward, wire bytes per step) of the strategy over `n`
    ranks, each `spread` ranks apart (a tensor split's neighbours hold the other shares: `work.model` is one
    rank's). `replicated`: ddp's data axis under a model split, FSDP2's replicate as disttrain runs it (DDP cannot hold
    a tensor split's DTensors): each unit's gradients all-reduced when its backward ends, in FSDP's reduce dtype, no
    buckets. `pipelined`: a pipeline stage's data axis, whose parameters are gathered once a step and again for
    each backward where resharded after forward (`step_time`)."""
    model, (stored, gathered, _) = work.model, BYTES[work.precision]
    stored_dtype, gathered_dtype, _ = WIRE_DTYPES[work.precision]
    reduced_type = reduced_dtype(work.precision, work.grad_compression)
    reduced = ITEMSIZE[reduced_type]
    ddp_dtype = reduced_type if work.grad_compression in COMPRESSED else stored_dtype  # (DDP's hook sends it)
    ddp_wire = ITEMSIZE[ddp_dtype]

    def wire(collective: str, nbytes: float, ranks: int, times: float = 1, dtype: str = "float32",
             groups: int = spread) -> float:
        """Seconds of one call over `ranks` ranks, each of `groups` ranks apart (hsdp's replicas, a tensor split's
        data-parallel groups: a node holds devices per node / groups of them, each on its share of the node's
        network)."""
        nonlocal sent
        sent += times * nbytes * bus_factor(collective, ranks)
        links = net.for_dtype(dtype, collective)
        if groups > 1:
            links = replace(links, gpus_per_node=max(1, links.gpus_per_node // groups))
        return collective_time(collective, nbytes, ranks, links)

    sent = 0.0
    sharded = strategy not in ("ddp", "zero1") or replicated
    if sharded and work.grad_compression == "powersgd":
        raise ConfigError(f"parallel.grad_compression = 'powersgd' is a DDP communication hook: {strategy} does not "
                          "run it; predict ddp or zero1 with it, or the others with none, fp16 or bf16")
    g = net.gpus_per_node
    shard = 1 if replicated else (work.hsdp_shard or min(n, g)) if strategy == "hsdp" else n
    if n % shard:
        raise ConfigError(f"parallel.hsdp_shard_size = {shard}: it does not divide {n} GPUs into sharding groups; "
                          f"give GPU counts that are multiples of it")
    if strategy == "hsdp" and n > g and shard % g and g % shard:  # (groups are consecutive ranks)
        raise ConfigError(f"parallel.hsdp_shard_size = {shard}: its sharding groups would straddle nodes of {g} "
                          f"devices unevenly, which the model does not price; give a divisor or a multiple of {g}")
    # The Trainer's small collectives that block a step, exposed after backward: on one CPU host each costs a call
    # (a hand-off and wake-ups: skipping the figures' gather took 0.5-2.5 ms off a 2-rank ddp step here), on GPUs
    # a ring's latency (tens of microseconds in a node, ~1 ms over 1024 GPUs). The optimizer step all-reduces the
    # squared gradient norm where the gradients are sharded (spec.total_norm, float64); a logged line gathers the
    # ranks' figures. (The step's loss totals are all-reduced too, but that starts before the last backward and is
    # done before anyone waits: skipping it changed a 2-rank ddp step here by nothing.)
    after = wire("all_reduce", 8, shard) if sharded else 0.0
    if work.log_every:
        after += wire("all_gather", 40 * n * spread, n * spread, times=1 / work.log_every, groups=1) / work.log_every
    shapes = model.units()
    flops = sum(u.forward_flops + u.backward_flops for u in shapes)
    if not sharded:
        grads, calls = bucket_calls(model, work, stored, ddp_wire)
        blocking = work.grad_compression == "powersgd" and not work.cpu_cores  # (the hook's device synchronize)
        units = bucket_units(shapes, flops, grads, calls, lambda nbytes: wire("all_reduce", nbytes, n,
                                                                               dtype=ddp_dtype),
                              net.for_dtype(ddp_dtype, "all_reduce"), n, blocking)
        if strategy == "zero1":
            after += wire("all_gather", model.trained_params * stored, n, dtype=stored_dtype)
        return units, after, sent
    replicas = n // shard
    units = []
    for i, u in enumerate(shapes):
        # gathered again for backward where the block's backward runs, or one of the next `prefetch` units' does (a
        # unit's pre-backward gathers the unit before it in forward order, run or not, FSDP2's implicit prefetch, or
        # the `parallel.fsdp_prefetch` units before it; the root's, which always runs, the last block); the root
        # stays gathered, but for a pipeline stage's, resharded after forward as its blocks are (parallel/fsdp.py).
        # A pipeline stage keeps what a backward gathered until the step; what resharded after forward without one
        # is gathered by each forward.
        follows = i + 1 == len(shapes) or any(s.backward_flops > 0 for s in shapes[i + 1:i + 1 + work.prefetch])
        reshards = strategy in ("fsdp", "hsdp")
        again = reshards and (pipelined if i == 0 else u.backward_flops > 0 or follows)
        gathers = (1 + work.micro_steps * again if again or not reshards else work.micro_steps) if pipelined else \
            work.micro_steps * (2 if again else 1)
        gather = wire("all_gather", u.params * gathered, shard, gathers,
                      dtype=gathered_dtype)
        reduce = wire("reduce_scatter", u.trained * reduced, shard, dtype=reduced_type)
        if replicas > 1:  # hsdp: the shard's gradient is all-reduced across the replicas
            reduce += wire("all_reduce", u.trained * reduced / shard, replicas, dtype=reduced_type,
                           groups=shard * spread)
        units.append(Unit(u.forward_flops / flops, u.backward_flops / flops, gather, gather if again else 0.0, reduce))
    return units, after, sent


def step_time(strategy: str, n: int, work: Workload, net: Interconnect, model_split: bool = False,
              pipelined: bool = False) -> Step:
    """One optimizer step on `n` devices (weak scaling: `work` is one device's share at every `n`); `model_split`: the
    data axis of a model split (a tensor or context split is one by itself), where ddp runs as FSDP2's replicate
    (`_units`);
    `pipelined`: a pipeline stage's, where a sharded strategy gathers its parameters once a step and, where it
    reshards them after forward (fsdp), again for each micro-batch's backward: torch's pipeline stage keeps them
    gathered after a backward until the step (`set_reshard_after_backward(False)`)."""
    strategy = canonical_strategy(strategy)
    local = min(n, net.gpus_per_node)
    slowdown = max(1.0, local / work.cpu_cores) if work.cpu_cores else 1.0
    compute = work.compute_s * slowdown
    if n == 1:  # (under a pipeline, its stages on one device; under a tensor split, one of its ranks alone)
        return Step(compute * work.pipeline, compute * work.pipeline, 0.0, 0.0)
    check_context(strategy, n, work, net)  # (under a pipeline too: each stage's ranks cut the sequence)
    if work.pipeline > 1:
        return _pipeline_step(strategy, n, work, net)
    check_tensor(strategy, n, work, net)
    units, after, sent = _units(strategy, replace(work, model=split_shape(work.model, work.tensor)),
                                n // work.tensor, net, work.tensor,
                                strategy == "ddp" and (model_split or work.tensor > 1 or work.context > 1), pipelined)
    (split_fwd, split_bwd, split_step), (sent_micro, sent_step) = split_seconds(work, net)
    split = (split_fwd + split_bwd) * work.micro_steps
    sent += sent_micro * work.micro_steps + sent_step
    after += split_step  # (after backward, before the optimizer's update)
    # (a pipeline stage's units stay gathered after their first forward, but those resharded after it and not
    # gathered for backward: fsdp's frozen ones)
    stays = [pipelined and (u.gather_bwd > 0 or strategy not in ("fsdp", "hsdp")) for u in units]
    comm_total = (sum(u.gather_fwd * (1 if kept else work.micro_steps) + u.gather_bwd * work.micro_steps
                      for u, kept in zip(units, stays, strict=True))
                  + sum(u.reduce for u in units) + after + split)
    if work.cpu_cores and local >= work.cpu_cores:  # no free core: gloo's threads take turns with compute
        charged = comm_total - waits_behind_backward(units)
        return Step(compute + charged * slowdown, compute, comm_total * slowdown, sent)
    seconds = compute / work.micro_steps
    if split:  # a tensor or context split's calls run in line with the compute, spread over the units by their shares
        busy = seconds + split_fwd + split_bwd
        forward, backward = sum(u.forward for u in units), sum(u.backward for u in units)
        units = [replace(u, forward=(u.forward * seconds + split_fwd * u.forward / forward) / busy,
                         backward=(u.backward * seconds + split_bwd * u.backward / backward) / busy)
                 for u in units]
        seconds = busy
    later = [replace(u, gather_fwd=0.0) if kept else u for u, kept in zip(units, stays, strict=True)]
    t = comm = 0.0
    for m in range(work.micro_steps):
        t, comm = run_pass(later if m else units, seconds, "forward", "gather_fwd", False, t, comm, work.prefetch)
        t, comm = run_pass(units[::-1], seconds, "backward", "gather_bwd", m == work.micro_steps - 1, t, comm,
                        work.prefetch)
    return Step(max(t, comm) + after, compute, comm_total, sent)


def _pipeline_step(strategy: str, n: int, work: Workload, net: Interconnect) -> Step:
    """A pipeline of p ranks (n / p GPUs a stage), v stages a rank: the schedule played through
    (`pipeline_timeline.play`: each rank runs its computations in the schedule's order, each when its rank is free
    and its input has come; a stage's forward and backward as its units' FLOPs share its compute, a split backward
    half and half), each stage's micro-batch holding its tensor or context split's calls (a context split's: its
    blocks'); then each rank's data-parallel collectives beyond its computations (`step_time` on the rank's stages
    together), and the sum of a tied embedding and head's gradients between the first and last stage where two
    ranks hold them (`tied_bytes`). A send of `send_bytes` between ranks delays the computation waiting for it
    (across nodes once the job spans several); on a CPU host it is a call on each rank's timeline instead, 2 v a
    micro-batch."""
    p, m, v = work.pipeline, work.micro_steps, check_pipeline(strategy, n, work)
    apart = n > net.gpus_per_node  # (a stage boundary on other nodes)

    def link(dtype: str, collective: str) -> Interconnect:
        links = net.for_dtype(dtype, collective)
        return replace(links, gpus_per_node=1) if apart else replace(links, gpus_per_node=2)

    stored, stream, _ = WIRE_DTYPES[work.precision]
    send = collective_time("all_gather", 2 * work.send_bytes, 2, link(stream, "all_gather"))  # (each sends its half)
    holder = functools.partial(mesh.holder, ranks=p, schedule=work.schedule)
    tied_bytes = work.tied_bytes if holder(0) != holder(p * v - 1) else 0.0  # (a V's rank 0 holds both ends)
    tied = collective_time("all_reduce", tied_bytes, 2, link(stored, "all_reduce"))
    held = [mesh.stages_of(rank, p, p * v, work.schedule) for rank in range(p)]
    computes, costs = _stage_costs(work, net)
    if strategy == "fsdp" and work.schedule in mesh.SPLIT_BACKWARD_SCHEDULES:
        strategy = "zero2"
    steps, busy = [], []
    for rank, mine in enumerate(held):
        shape = replace(joined(f"pipeline rank {rank}", [work.stages[s].units()[0] for s in mine],
                               [u for s in mine for u in work.stages[s].units()[1:]], work.model.seq_len),
                        kv_width=work.model.kv_width)
        calls = tuple(c for s in mine for c in work.stage_calls[s]) + work.step_calls[rank] if work.tensor > 1 else ()
        compute = sum(computes[s] for s in mine) + (2 * m * v * send if work.cpu_cores else 0.0)
        steps.append(step_time(strategy, n // p, replace(work, model=shape, compute_s=compute, pipeline=1, stages=(),
                                                         stage_calls=(), step_calls=(), orders=(), tensor_calls=calls,
                                                         context_calls=rank_context_calls(work, mine)),
                               net, model_split=True, pipelined=True))
        busy.append(compute + m * sum(costs[s].whole() - computes[s] / m for s in mine))
    orders = work.orders or tuple(one_stage_order(work.schedule, p, rank, m) for rank in range(p))
    try:
        finish = play(orders, holder, costs, send, on_host=bool(work.cpu_cores))
    except ValueError as exc:
        raise ConfigError(f"parallel.pipeline_schedule = {work.schedule!r}: the order this torch gives it cannot be "
                          f"played ({exc}); predict gpipe or 1f1b") from None
    ends = [finish[r] + steps[r].step_s - busy[r] for r in range(p)]  # (its collectives beyond its computations)
    last = max(range(p), key=lambda r: ends[r])
    sent = 2 * m * v * work.send_bytes + tied_bytes
    return Step(ends[last] + tied, work.compute_s, steps[last].comm_s + 2 * m * v * send + tied,
                steps[last].wire_bytes + sent)


def _stage_costs(work: Workload, net: Interconnect) -> tuple[list[float], tuple[StageCost, ...]]:
    """(each stage's compute in a step, the seconds of one micro-batch's forward and backward through it): its share
    of the FLOPs (`compute_s` is a GPU's share of equal stages), forward and backward as its units' FLOPs say, each
    with its tensor or context split's calls."""
    total, p, m = work.model.flops_per_token(), work.pipeline, work.micro_steps
    computes, costs = [], []
    for s, stage in enumerate(work.stages):
        units = stage.units()
        flops = sum(u.forward_flops + u.backward_flops for u in units)
        forward = sum(u.forward_flops for u in units) / flops if flops else 1 / 3
        compute = work.compute_s * p * stage.flops_per_token() / total
        calls = work.stage_calls[s] if work.tensor > 1 else ()
        (split_fwd, split_bwd, _), _ = split_seconds(replace(work, tensor_calls=calls,
                                                             context_calls=stage_context_calls(work, stage)), net)
        computes.append(compute)
        backward = compute / m * (1 - forward)
        # (torch runs a split backward's first stage whole, as the weight part: its input has no gradient)
        first = s == 0 and work.schedule in mesh.SPLIT_BACKWARD_SCHEDULES
        costs.append(StageCost(compute / m * forward + split_fwd, backward + split_bwd if first else backward,
                               0.0 if first else split_bwd, (0.0, backward + split_bwd) if first else ()))
    return computes, tuple(costs)


SPLIT_NAMES = "parallel.tensor x parallel.pipeline x parallel.context"
"""The settings whose product is the GPUs that read one batch together."""


@dataclass
class Prediction:
    gpus: int
    step: Step
    tokens_per_s_per_gpu: float
    efficiency: float
    """Per-GPU throughput relative to the smallest count predicted."""


def predict(strategy: str, counts: list[int], work: Workload, net: Interconnect, alone: Workload | None = None
            ) -> list[Prediction]:
    """Each count's step; `alone`: the workload at a count of one group of a split, where it differs (no data axis
    beside it)."""
    group = work.tensor * work.pipeline * work.context
    odd = [n for n in counts if n % group]
    if odd:
        raise ConfigError(f"--gpus {odd[0]}: a group of {SPLIT_NAMES} = {group} GPUs reads one batch; give multiples "
                          f"of {group}")
    per_node = net.gpus_per_node
    partial_nodes = [n for n in counts if n > per_node and n % per_node]
    if strategy == "hsdp" and not work.hsdp_shard and partial_nodes:  # (its replicas are whole nodes)
        raise ConfigError(f"--gpus {partial_nodes[0]}: hsdp shards within a node of {per_node} devices and "
                          f"replicates across nodes; give at most {per_node} or a multiple of {per_node}")
    steps = [(n, step_time(strategy, n, alone if alone and n == group else work, net)) for n in sorted(counts)]
    base = steps[0][1].step_s
    return [Prediction(n, s, work.tokens / s.step_s, base / s.step_s) for n, s in steps]


def compute_seconds(model: ModelShape, tokens: float, tflops: float, mfu: float) -> float:
    """One device's step compute from FLOPs: tokens x FLOPs per token / (peak x MFU)."""
    if not (model.matmul_params or model.counted):
        raise ConfigError(f"the FLOPs of {model.name} are not modelled; give --compute-s (seconds of one step on "
                          "one device)")
    return tokens * model.flops_per_token() / (tflops * 1e12 * mfu)


H100_BF16_TFLOPS = 989.0
"""H100 SXM dense bf16 peak (NVIDIA's datasheet; 1979 is with sparsity)."""
H100_FP32_TFLOPS = 67.0
"""H100 SXM fp32 peak, for fp32 matmuls (TensorFloat-32, 494, only where torch is allowed to use it)."""
