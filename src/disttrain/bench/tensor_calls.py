"""The collectives a tensor-parallel step sends, counted by running it: the config's model is built without memory
(fake tensors on the CPU), split by disttrain's own plan (parallel/tensor.py) over a fake process group of the
tensor degree, and one sequence's forward and backward run under the precision's autocast (and activation
checkpointing, where set), then the clip's norm and the optimizer's update, each collective DTensor issues
recorded with its size and element type. The scale model
prices them (`Workload.tensor_calls`); `fake_group` also lets `bench predict --measure` time one tensor rank's compute
alone.

Recorded rather than written down because torch's plan decides them: each column-wise linear all-reduces its own
input's gradient (q, k and v three times, not once as in Megatron), the embedding's output is all-reduced in the
parameters' dtype and the blocks' outputs in the compute dtype.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import NamedTuple

from disttrain.config import Config
from disttrain.errors import ConfigError

COLLECTIVES = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
               "reduce_scatter_tensor": "reduce_scatter"}
"""torch's functional collectives as the scale model names them."""


@dataclass(frozen=True)
class TensorCall:
    part: str
    """"forward", "backward" (recomputed forwards under activation checkpointing included) or "step" (once a step,
    after the last backward)."""
    collective: str
    nbytes: float
    """nccl-tests' size (the whole tensor: an all-gather's output, a reduce-scatter's input), for one sequence in
    forward and backward."""
    dtype: str


@contextlib.contextmanager
def fake_group(size: int) -> Iterator[None]:
    """A process group of `size` ranks held by this process alone, as rank 0, whose collectives return at once (torch's
    `fake` backend): a rank's compute with none of its communication. Destroyed on leaving."""
    import torch.distributed as dist

    form_fake_group(size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def form_fake_group(size: int, rank: int = 0) -> None:
    """`fake_group`'s group, formed for the rest of the process as `rank` (its runtime's shutdown destroys it)."""
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

    if dist.is_initialized():
        raise RuntimeError("a process group is already formed in this process; count in a fresh one")
    dist.init_process_group("fake", rank=rank, world_size=size, store=dist.HashStore())


def count(cfg: Config, precision: str = "", data_axis: bool = False) -> tuple[TensorCall, ...]:
    """The collectives of one sequence's forward and backward under the config's tensor split
    (`parallel.tensor`, `parallel.sequence_parallel`, `parallel.loss_parallel`), precision (`precision`, else
    `parallel.precision`) and activation checkpointing, then the step's (part "step": the clip's norm where
    `optim.grad_clip` > 0, and the optimizer's update, which sum the gradients backward left partial); () where the
    model is not split. Under `parallel.pipeline` > 1 the whole model's (`count_stages` gives each stage's).

    `data_axis`: the job has data-parallel ranks beside the split, which disttrain runs as FSDP2 (ddp as its
    replicate): under a mixed precision it computes with parameters gathered in the compute dtype, so the stream's
    calls (the embedding's output, the norms' outputs and their gradients) travel in it, not in float32; the step's
    stay in the stored dtype."""
    return _counted(cfg, precision, data_axis, stages=False)


class StageCalls(NamedTuple):
    stages: tuple[tuple[TensorCall, ...], ...]
    """Each pipeline stage's forward and backward calls (stage order)."""
    steps: tuple[tuple[TensorCall, ...], ...]
    """Each pipeline rank's step calls, once for all its stages (one clip's norm over its gradients)."""


def count_stages(cfg: Config, precision: str = "", data_axis: bool = False) -> StageCalls:
    """Under `parallel.pipeline` > 1 with a tensor split: `count`'s calls of each pipeline stage, recorded as the
    pipeline runs it (`parallel/stages.StagePart`: the embedding on the first, the final norm and head on the last,
    whose logits are gathered whole: no loss parallel under a pipeline; a later stage's input is what the one before
    sends, a sequence's stream, under sequence parallelism its share of the sequence), and each rank's step, as its
    stages' gradients are normed and updated together."""
    return _counted(cfg, precision, data_axis, stages=True)


def _counted(cfg: Config, precision: str, data_axis: bool, stages: bool):
    degree = cfg.parallel.tensor
    if degree <= 1:
        return StageCalls(((),) * _stage_count(cfg), ((),) * cfg.parallel.pipeline) if stages else ()
    precision = precision or cfg.parallel.precision
    key = repr((cfg.model, cfg.parallel, cfg.optim, precision, data_axis, stages))  # (a sitting measures, checks)
    if key not in _COUNTED:
        from disttrain.precision import get_precision

        gathered = data_axis and get_precision(precision).fsdp_policy() is not None
        stored = _record_all(cfg, degree, precision, stages, gathered=False)
        if gathered:  # forward and backward on FSDP2's gathered copies, the step on the stored parameters
            computed = _record_all(cfg, degree, precision, stages, gathered=True)
            stored = (StageCalls(computed.stages, stored.steps) if stages else
                      tuple(c for c in computed if c.part != "step") + tuple(c for c in stored if c.part == "step"))
        _COUNTED[key] = stored
    return _COUNTED[key]


def _stage_count(cfg: Config) -> int:
    from disttrain.parallel.mesh import stage_count

    return stage_count(cfg.parallel, cfg.parallel.pipeline)


def _record_all(cfg: Config, degree: int, precision: str, stages: bool, gathered: bool):
    model = meta_built(cfg.model, f"parallel.tensor = {degree}", "its collectives", "use --model PRESET")
    with fake_group(degree):
        return _record(model, cfg, degree, precision, stages, gathered)


_COUNTED: dict[str, tuple[TensorCall, ...] | StageCalls] = {}


def meta_built(model_cfg, setting: str, counted: str, hint: str):
    """The config's model built on the meta device (no memory) to count `counted`, or one line naming `setting`
    where it cannot be (a factory of the user's that reads values), with `hint`."""
    from disttrain.memory import meta_model

    try:
        return meta_model(model_cfg)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"{setting}: the model cannot be built on the meta device to count {counted} "
                          f"({type(exc).__name__}: {exc}); {hint}") from None


def _record(model, cfg: Config, degree: int, precision_name: str, stages: bool, gathered: bool):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    from disttrain.parallel import tensor
    from disttrain.parallel.activation_checkpoint import apply_activation_checkpointing
    from disttrain.parallel.state import tie_groups
    from disttrain.precision import get_precision

    mesh = init_device_mesh("cpu", (degree,), mesh_dim_names=("tp",))
    precision = get_precision(precision_name)
    pipeline = cfg.parallel.pipeline if stages else 1
    split = tensor.splits_logits(cfg.parallel, SimpleNamespace(tensor=degree, pipeline=pipeline),
                                 tensor.vocabulary(model))
    ties = tie_groups(model) if stages else []  # (before the fake tensors, which untie them)
    dtype = precision.compute_dtype if gathered else precision.param_dtype
    if dtype is not None:  # (on the meta device: fake tensors cannot be swapped for others)
        model.to(dtype)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = model.to_empty(device="cpu")
        if cfg.parallel.activation_checkpointing:
            apply_activation_checkpointing(model)
        tensor.parallelize(model, mesh, cfg.parallel.sequence_parallel, split)
        run = _Run(model, cfg, precision, split, ties)
        if not stages:
            return run.passes(model) + run.step([model], holds_first=True)
        return _record_stages(model, cfg, degree, run)


def _record_stages(model, cfg: Config, degree: int, run: _Run) -> StageCalls:
    import torch

    from disttrain.parallel import tensor
    from disttrain.parallel.mesh import stages_of
    from disttrain.parallel.stages import FAMILIES, StagePart, family_of, stage_bounds

    family, count, p = FAMILIES[family_of(model)], _stage_count(cfg), cfg.parallel.pipeline
    width = cfg.model.seq_len // (degree if cfg.parallel.sequence_parallel else 1)
    stream = torch.zeros(1, width, tensor.hidden_size(model), dtype=next(model.parameters()).dtype)
    parts = [StagePart(model, family, bounds, s == 0, s == count - 1)
             for s, bounds in enumerate(stage_bounds(model, count, cfg.parallel.pipeline_split))]
    calls, steps = [()] * count, []
    for rank in range(p):  # (each rank's stages: their gradients accumulate until its step)
        held = stages_of(rank, p, count, cfg.parallel.pipeline_schedule)
        for s in held:
            calls[s] = run.passes(parts[s], None if s == 0 else stream, ends=s == count - 1)
        steps.append(run.step([parts[s] for s in held], holds_first=0 in held))
    return StageCalls(tuple(calls), tuple(steps))


class _Run:
    """Runs parts of the split model on fake tensors and records their calls."""

    def __init__(self, model, cfg: Config, precision, split: bool, ties: list[list[str]]):
        self.model, self.cfg, self.precision, self.split, self.ties = model, cfg, precision, split, ties

    def passes(self, part, stream=None, ends: bool = True) -> tuple[TensorCall, ...]:
        """One sequence's forward and backward through `part`: from the tokens, or a `stream` as the stage before
        sends it; to the loss where it `ends` in logits (the whole model, the last stage), else to its output, whose
        gradient comes back. Its parameters' gradients accumulate, as a rank's stages' do until its step."""
        import torch

        from disttrain.parallel import tensor

        tokens = torch.zeros(1, self.cfg.model.seq_len, dtype=torch.long)
        loss_context = tensor.loss_parallel if self.split else contextlib.nullcontext
        with recording() as recorder:
            with self.precision.autocast("cpu"), loss_context():
                out = part(tokens if stream is None else stream.clone().requires_grad_())
                if ends:
                    logits = out if isinstance(out, torch.Tensor) else out.logits
                    out = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
            recorder.part = "backward"
            with loss_context():
                out.backward(None if ends else torch.zeros(out.shape, dtype=out.dtype))
        return tuple(recorder.calls)

    def step(self, parts: list, holds_first: bool) -> tuple[TensorCall, ...]:
        """The step's calls over the gradients `parts` hold: the clip's norm (`optim.grad_clip` > 0) and the
        optimizer's update, which sum the gradients backward left partial. A pipeline's tied weight is laid out and
        counted as its step does: in the first stage's norm only."""
        from disttrain.optim import optimizer_factory
        from disttrain.parallel.spec import squared_norm

        params = list(dict.fromkeys(p for part in parts for p in part.parameters()))
        _tied_as_held(self.model, params, self.ties)
        counted = {id(self.model.get_parameter(names[0])) for names in self.ties} if holds_first else set()
        skip = {id(self.model.get_parameter(n)) for names in self.ties for n in names} - counted
        with recording() as recorder:
            recorder.part = "step"
            if self.cfg.optim.grad_clip > 0:
                squared_norm([p.grad for p in params if p.grad is not None and id(p) not in skip])
            optimizer_factory(self.cfg.optim)(SimpleNamespace(parameters=lambda: iter(params))).step()
        return tuple(recorder.calls)


def _tied_as_held(model, params: list, ties: list[list[str]]) -> None:
    """As the pipeline's step does before it sums a tied weight's gradients between the first and last stage
    (parallel/pipeline.py): a gradient left in another layout than its weight's (an embedding's, replicated) is
    laid out as the weight (no communication: each rank keeps its rows), so the clip's norm counts it with them."""
    held = {id(p) for p in params}
    for param in (model.get_parameter(name) for names in ties for name in names):
        grad = param.grad
        if id(param) in held and grad is not None and hasattr(grad, "placements") and \
                grad.placements != param.placements:
            param.grad = grad.redistribute(placements=param.placements)


PROCESS_GROUP_CALLS = {"allgather_": "all_gather", "_reduce_scatter_base_": "reduce_scatter", "send": "send"}
"""torch.distributed's list all-gather and its reduce-scatter of one tensor (a context split's, parallel/context.py)
as the scale model names them, and a point-to-point send (a pipeline stage's, of the stream between stages). FSDP2
gathers through the other all-gather, but reduce-scatters through this one: record a context split's calls beside a
data axis that shards no gradients (ddp, as tests/scripts/context_calls_job.py does)."""


@contextlib.contextmanager
def recording(process_group_calls: bool = False) -> Iterator:
    """Records each functional collective issued inside (DTensor's included: it runs before the recorder) as a
    `TensorCall` in `.calls`, of the part `.part` names ("forward" until set); with `process_group_calls`, also
    those of `PROCESS_GROUP_CALLS` (a context split's, a pipeline's sends)."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.part, self.calls = "forward", []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(t, DTensor) for t in types):  # (DTensor runs first, and its collectives come here)
                return NotImplemented
            name = getattr(func, "overloadpacket", func).__name__
            if getattr(func, "namespace", "") == "_c10d_functional" and name in COLLECTIVES:
                first = args[0]
                whole = args[1] if name == "all_gather_into_tensor" else 1  # (its group size)
                self.calls.append(TensorCall(self.part, COLLECTIVES[name], first.numel() * first.element_size() * whole,
                                             str(first.dtype).removeprefix("torch.")))
            elif process_group_calls and getattr(func, "namespace", "") == "c10d" and name in PROCESS_GROUP_CALLS:
                # (its input: a list of one, or the whole; a send's first argument, a list of one)
                sent = args[1][0] if name == "allgather_" else args[0][0] if name == "send" else args[1]
                whole = len(args[0][0]) if name == "allgather_" else 1  # (a list of the group's outputs)
                self.calls.append(TensorCall(self.part, PROCESS_GROUP_CALLS[name],
                                             sent.numel() * sent.element_size() * whole,
                                             str(sent.dtype).removeprefix("torch.")))
            return func(*args, **(kwargs or {}))

    with Recorder() as recorder:
        yield recorder
