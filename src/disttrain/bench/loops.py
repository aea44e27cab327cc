"""The loops the cost-of-scale benchmarks time (`bench overhead`, `bench scaling`, `bench predict --measure`,
`bench pipeline`, `bench gpu`): the loop a user writes by hand from the PyTorch (or DeepSpeed) tutorials
(`plain_loop`), the Trainer's own step with its in-run figures (`disttrain_loop`) and without them (`bare_loop`),
and the interleaved rounds that compare them (`compare`). A loop is built as `build(cfg, runtime, train, sampler)`
and returns `step(k)`, which trains step k and returns its loss (or the Trainer's values)."""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import time

import torch
import torch.nn.functional as F

from disttrain.bench import plain_model_parallel

PLAIN_PRECISIONS = ("fp32", "bf16-mixed")
"""The precisions the hand-written loops follow (bf16-mixed: the forward under autocast; FSDP2 also gathers in bf16
through its MixedPrecisionPolicy)."""


def plain_setup(cfg, strategy: str, device: torch.device | None = None, precision: str = "fp32"):
    """(module, optimizer, no_sync) wired by hand with torch's own engines, as their tutorials do; `precision` one of
    `PLAIN_PRECISIONS` (the caller runs the forward under autocast)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from disttrain.models.gpt import GPT
    device = device or torch.device("cpu")
    torch.manual_seed(cfg.run.seed)
    model = GPT(cfg.model).to(device)
    optimizer = plain_model_parallel.hand_written_adamw(model, cfg.optim)
    if strategy in ("ddp", "zero1"):
        module = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                     bucket_cap_mb=cfg.parallel.bucket_cap_mb, gradient_as_bucket_view=True)
        if strategy == "zero1":
            optimizer = ZeroRedundancyOptimizer([dict(g) for g in optimizer.param_groups],
                                                optimizer_class=torch.optim.AdamW, lr=cfg.optim.lr,
                                                betas=(cfg.optim.beta1, cfg.optim.beta2))
        return module, optimizer, module.no_sync
    kwargs: dict = {"reshard_after_forward": strategy != "zero2"}
    if precision == "bf16-mixed":  # gathered in bf16, gradients reduced in fp32
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if strategy == "hsdp":  # replicate x shard; one group of all ranks (parallel.hsdp_shard_size = 0)
        from torch.distributed.device_mesh import init_device_mesh

        world = torch.distributed.get_world_size()
        kwargs["mesh"] = init_device_mesh(device.type, (1, world), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **{**kwargs, "reshard_after_forward": False})  # the root stays gathered into backward
    optimizer = plain_model_parallel.hand_written_adamw(model, cfg.optim)  # over the sharded parameters

    @contextlib.contextmanager
    def no_sync():
        model.set_requires_gradient_sync(False)
        yield
        model.set_requires_gradient_sync(True)

    return model, optimizer, no_sync


def _plain_deepspeed_loop(cfg, runtime, train, sampler):
    """The loop a DeepSpeed user writes from its tutorials: `deepspeed.initialize` with a torch AdamW and
    a ZeRO config, then engine(x), engine.backward(loss), engine.step() per micro-batch."""
    os.environ.setdefault("DS_ACCELERATOR", runtime.device.type)  # as disttrain's engine sets it (read at import)
    import deepspeed

    from disttrain.data import fetch, split_micro
    from disttrain.models.gpt import GPT
    from disttrain.optim import scheduler_factory

    torch.manual_seed(cfg.run.seed)
    model = GPT(cfg.model).to(runtime.device)
    optimizer = plain_model_parallel.hand_written_adamw(model, cfg.optim)
    d = cfg.data
    accum = d.global_batch_size // (d.micro_batch_size * runtime.world_size)
    config = {"train_micro_batch_size_per_gpu": d.micro_batch_size, "gradient_accumulation_steps": accum,
              "gradient_clipping": cfg.optim.grad_clip, "zero_optimization": {"stage": cfg.parallel.deepspeed_stage},
              "steps_per_print": 10**9}
    scheduler = scheduler_factory(cfg.optim, cfg.train.steps)(optimizer)  # on the client optimizer's groups
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)

    def step(k: int) -> float:
        indices = sampler.rank_indices(k * d.global_batch_size, d.global_batch_size, runtime.world_size,
                                       runtime.rank)
        for idx in split_micro(indices, d.micro_batch_size):
            batch = {k: v.to(runtime.device) for k, v in fetch(train, idx).items()}
            logits = engine(batch["input_ids"])
            loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
            engine.backward(loss)  # DeepSpeed divides by the accumulation steps
            engine.step()  # steps the optimizer at the accumulation boundary only
        scheduler.step()
        return loss.item()

    return _untimed(step)


def plain_loop(cfg, runtime, train, sampler):
    """The loop a user writes by hand from the PyTorch tutorials (mean loss, no_sync, clip, step)."""
    from disttrain.data import fetch, split_micro
    from disttrain.optim import scheduler_factory

    if cfg.parallel.strategy == "deepspeed":
        return _plain_deepspeed_loop(cfg, runtime, train, sampler)
    if cfg.parallel.pipeline > 1 or cfg.parallel.tensor > 1:
        loop = plain_model_parallel.pipeline_loop if cfg.parallel.pipeline > 1 else plain_model_parallel.tensor_loop
        return loop(cfg, runtime, train, sampler)
    precision = cfg.parallel.precision
    if precision not in PLAIN_PRECISIONS:
        raise ValueError(f"the hand-written loop follows parallel.precision {' or '.join(PLAIN_PRECISIONS)}, not "
                         f"{precision}")  # (the benches refuse or skip it first: bench overhead's --set, scaling)
    model, optimizer, no_sync = plain_setup(cfg, cfg.parallel.strategy, runtime.device, precision)
    scheduler = scheduler_factory(cfg.optim, cfg.train.steps)(optimizer)
    d = cfg.data
    accum = d.global_batch_size // (d.micro_batch_size * runtime.world_size)
    bf16 = precision == "bf16-mixed"  # the forward under autocast, as disttrain runs it under every strategy

    def step(k: int) -> float:
        cursor = k * d.global_batch_size
        indices = sampler.rank_indices(cursor, d.global_batch_size, runtime.world_size, runtime.rank)
        micro = split_micro(indices, d.micro_batch_size)
        for i, idx in enumerate(micro):
            batch = {k: v.to(runtime.device) for k, v in fetch(train, idx).items()}
            ctx = no_sync() if i < len(micro) - 1 else torch.enable_grad()
            with ctx:
                with torch.autocast(runtime.device.type, torch.bfloat16, enabled=bf16):
                    logits = model(batch["input_ids"])
                    loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()) / accum
                loss.backward()
        if cfg.optim.grad_clip > 0:  # (0: no clipping, as in disttrain; e.g. --set optim.grad_clip=0)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


def disttrain_setup(cfg, runtime, train, sampler):
    """(trainer, backend, validation set, batches, micro-batches per step): what `disttrain train` builds on this
    rank, and its DataLoader over this rank's data shard of the stream (the layout's: a pipeline's or tensor-parallel
    job's ranks read the same samples)."""
    from disttrain.loader import Loaders, StepBatches
    from disttrain.trainer import Trainer

    trainer = Trainer(cfg, runtime=runtime)
    backend, _, val = trainer._setup(runtime)
    d = cfg.data
    steps = StepBatches(sampler, 0, 10**6, d.global_batch_size, d.micro_batch_size, *backend.data_parallel)
    batches = Loaders(d, trainer.collate_fn, runtime.device, cfg.run.seed).train(train, steps)
    return trainer, backend, val, batches, len(steps.step(0))


def disttrain_job(cfg, runtime, train, sampler):
    """(backend, validation set, step): the Trainer's backend and its own step (the code `disttrain train` runs)
    with its DataLoader over the same data stream; `step(k)` returns the step's values (`Trainer._train_step`) with
    the in-run cost figures (perf.py: MFU, communication time, memory; the slowest rank on the steps it logs, every
    `train.log_every`).
    The stream simply continues: batches of the same sizes; the step index `k` (the same on every rank) decides only
    which steps gather the ranks' figures, step k + 1 as the Trainer counts."""
    trainer, backend, val, batches, micro = disttrain_setup(cfg, runtime, train, sampler)

    def step(k: int) -> dict:
        values = trainer._train_step(backend, batches, micro)
        if (k + 1) % cfg.train.log_every == 0:  # a logged line, as the Trainer's (its steps count from 1)
            trainer._line_figures(values, runtime)
        return values

    return backend, val, step


def disttrain_loop(cfg, runtime, train, sampler):
    return disttrain_job(cfg, runtime, train, sampler)[2]


@contextlib.contextmanager
def _untimed_deepspeed():
    """deepspeed.comm's collectives as its class defines them, for the duration: disttrain's DeepSpeed engine times
    them by setting wrappers on the process-wide `cdb` (`parallel/deepspeed/timed.py`), which would otherwise time
    the loops built after it too."""
    cdb = getattr(sys.modules.get("deepspeed.comm.comm"), "cdb", None)
    from disttrain.parallel.deepspeed.timed import DEEPSPEED_COLLECTIVES

    saved = {name: vars(cdb).pop(name) for name in DEEPSPEED_COLLECTIVES if cdb is not None and name in vars(cdb)}
    try:
        yield
    finally:
        for name, wrapper in saved.items():
            setattr(cdb, name, wrapper)


def _untimed(step):
    """`step`, run with deepspeed.comm's collectives untimed (`_untimed_deepspeed`)."""
    def run(k: int):
        with _untimed_deepspeed():
            return step(k)
    return run


def bare_loop(cfg, runtime, train, sampler):
    """disttrain's step without its in-run figures: the strategy's collectives not wrapped by the communication
    meter (`comm.meter_for` gives None while the backend is built, as on a device it does not time: no comm_s, no
    comm_bytes) and no gather of the ranks' figures (step time of the slowest rank, peak memory). What is left of
    them (the step's clock, the MFU's arithmetic) costs microseconds. Against `disttrain_loop`, this is what the
    figures cost."""
    from disttrain.parallel import comm

    timed = comm.meter_for
    comm.meter_for = lambda *args, **kwargs: None
    try:
        trainer, backend, _, batches, micro = disttrain_setup(cfg, runtime, train, sampler)
    finally:
        comm.meter_for = timed
    step = lambda k: trainer._train_step(backend, batches, micro)  # noqa: E731
    return _untimed(step) if cfg.parallel.strategy == "deepspeed" else step  # (nothing added to the others' steps)


LOOPS = {"plain": plain_loop, "disttrain": disttrain_loop, "bare": bare_loop}
"""The loops `compare` times: hand-written, disttrain's step with its figures, disttrain's step without them."""


def time_steps(step, first: int, steps: int, results: list | None = None) -> list[float]:
    times = []
    for k in range(first, first + steps):
        start = time.perf_counter()
        out = step(k)
        times.append(time.perf_counter() - start)
        if results is not None:
            results.append(out)
    return times


def compare(args, cfg, runtime, train, sampler, builders=None, results=None) -> dict[str, list[float]]:
    """Step times of the hand-written loop and disttrain's (or of `builders`, name -> `build(cfg, runtime, train,
    sampler) -> step`), interleaved in rounds; `results[name]`, when given, collects what each timed step returned."""
    import torch.distributed as dist

    builders = builders or LOOPS
    times: dict[str, list[float]] = {name: [] for name in builders}
    # Whichever loop is built second runs ~7% slower here (measured plain vs plain: memory placement),
    # so half of the rounds build the loops in one order and half in the reverse: every pair of loops is built
    # in both orders, and each loop's mean place in the build order is the same (with three loops, the middle
    # one, disttrain's, is built second both times).
    for order in (list(builders), list(builders)[::-1]):
        loops = {name: builders[name](cfg, runtime, train, sampler) for name in order}
        for step in loops.values():  # warm-up: allocator, DDP bucket rebuild, first-touch pages
            time_steps(step, 0, 3)
        for r in range(args.rounds // 2):
            for name, step in loops.items() if r % 2 == 0 else reversed(loops.items()):
                dist.barrier()
                kept = None if results is None else results.setdefault(name, [])
                times[name] += time_steps(step, r * args.steps, args.steps, kept)
        del loops, step
        gc.collect()
    return times
