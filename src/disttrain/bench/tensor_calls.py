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


def form_fake_group(size: int) -> None:
    """`fake_group`'s group, formed for the rest of the process (its runtime's shutdown destroys it)."""
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

    if dist.is_initialized():
        raise RuntimeError("a process group is already formed in this process; count in a fresh one")
    dist.init_process_group("fake", rank=0, world_size=size, store=dist.HashStore())


def count(cfg: Config, precision: str = "") -> tuple[TensorCall, ...]:
    """The collectives of one sequence's forward and backward under the config's tensor split
    (`parallel.tensor`, `parallel.sequence_parallel`, `parallel.loss_parallel`), precision (`precision`, else
    `parallel.precision`) and activation checkpointing, then the step's (part "step": the clip's norm where
    `optim.grad_clip` > 0, and the optimizer's update, which sum the gradients backward left partial); () where the
    model is not split."""
    degree = cfg.parallel.tensor
    if degree <= 1:
        return ()
    key = repr((cfg.model, cfg.parallel, cfg.optim, precision))  # (a sitting's measuring and checking ask alike)
    if key not in _COUNTED:
        model = meta_built(cfg.model, f"parallel.tensor = {degree}", "its collectives", "use --model PRESET")
        with fake_group(degree):
            _COUNTED[key] = _record(model, cfg, degree, precision or cfg.parallel.precision)
    return _COUNTED[key]


_COUNTED: dict[str, tuple[TensorCall, ...]] = {}


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


def _record(model, cfg: Config, degree: int, precision_name: str) -> tuple[TensorCall, ...]:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    from disttrain.optim import optimizer_factory
    from disttrain.parallel import tensor
    from disttrain.parallel.activation_checkpoint import apply_activation_checkpointing
    from disttrain.parallel.spec import squared_norm
    from disttrain.precision import get_precision

    mesh = init_device_mesh("cpu", (degree,), mesh_dim_names=("tp",))
    precision = get_precision(precision_name)
    split = tensor.splits_logits(cfg.parallel, SimpleNamespace(tensor=degree, pipeline=1), tensor.vocabulary(model))
    if precision.param_dtype is not None:  # (on the meta device: fake tensors cannot be swapped for others)
        model.to(precision.param_dtype)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = model.to_empty(device="cpu")
        if cfg.parallel.activation_checkpointing:
            apply_activation_checkpointing(model)
        tensor.parallelize(model, mesh, cfg.parallel.sequence_parallel, split)
        tokens = torch.zeros(1, cfg.model.seq_len, dtype=torch.long)
        loss_context = tensor.loss_parallel if split else contextlib.nullcontext
        with recording() as recorder:
            with precision.autocast("cpu"), loss_context():
                out = model(tokens)
                logits = out if isinstance(out, torch.Tensor) else out.logits
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
            recorder.part = "backward"
            with loss_context():
                loss.backward()
            recorder.part = "step"  # the gradients tensor parallelism leaves partial are summed where first read
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            if cfg.optim.grad_clip > 0:
                squared_norm(grads)
            optimizer_factory(cfg.optim)(model).step()
    return tuple(recorder.calls)


@contextlib.contextmanager
def recording() -> Iterator:
    """Records each functional collective issued inside (DTensor's included: it runs before the recorder) as a
    `TensorCall` in `.calls`, of the part `.part` names ("forward" until set)."""
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
            return func(*args, **(kwargs or {}))

    with Recorder() as recorder:
        yield recorder
