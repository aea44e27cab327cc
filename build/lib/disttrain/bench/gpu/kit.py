"""What every check of `disttrain bench gpu` uses: a check's outcome (`Check`), the model sizes, a Config of the
reference GPT, this process as a one-rank runtime, a backend on it, the synthetic batches, one step, and the
comparisons and formats of the figures."""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

SMALL = {"n_layer": 4, "d_model": 256, "n_head": 4, "seq_len": 256, "vocab_size": 256}
MEDIUM = {"n_layer": 24, "d_model": 1024, "n_head": 16, "seq_len": 1024, "vocab_size": 8192}  # activations lead
OFFLOAD = {"n_layer": 12, "d_model": 2048, "n_head": 16, "seq_len": 512, "vocab_size": 8192}  # states dominate
GIB = 2**30


class Skipped(Exception):
    """A check that cannot run here (an optional package is missing): reported SKIP, not FAIL."""


@dataclass
class Check:
    """One check's outcome. A check function fills `figures` as it goes, so a failure keeps what came before it."""

    name: str
    passed: bool = False
    figures: dict[str, str] = field(default_factory=dict)
    reason: str = ""
    """One line: the target, or why it failed or was skipped."""
    skipped: bool = False
    seconds: float = 0.0


def config(size: dict[str, int], micro: int, strategy: str, precision: str, extra: tuple[str, ...] = ()):
    """A disttrain Config of the reference GPT of `size` (what the estimator reads)."""
    from disttrain.config import load_config

    return load_config(None, [*(f"model.{k}={v}" for k, v in size.items()), f"data.micro_batch_size={micro}",
                              f"parallel.strategy={strategy}", f"parallel.precision={precision}", *extra])


def describe(size: dict[str, int], micro: int) -> str:
    return (f"GPT {size['n_layer']} x {size['d_model']} ({size['n_head']} heads), seq {size['seq_len']}, "
            f"vocab {size['vocab_size']}, micro-batch {micro}")


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"

# ----------------------------------------------------------------------------------------------
# Helpers on a device


def runtime(device, group: bool):
    """This process as rank 0 of 1: with a process group (nccl on CUDA, formed once, on an in-memory store) for
    strategies that need one, else without."""
    from disttrain.config import DistConfig
    from disttrain.runtime import LaunchInfo, Runtime, init_runtime

    if group:
        return init_runtime(DistConfig(device=device.type), environ={}, always_form_group=True)
    return Runtime(LaunchInfo("single"), device, "nccl" if device.type == "cuda" else "gloo", distributed=False)


def backend(cfg, runtime, grad_clip: float = 0.0, factory=None, **kwargs):
    import torch

    from disttrain.backend import create_backend
    from disttrain.models.gpt import GPT
    from disttrain.optim import optimizer_factory

    torch.manual_seed(0)
    with torch.device(runtime.device):  # initialised where it runs (a GPU initialises 1 B parameters in a blink)
        model = GPT(cfg.model)
    return create_backend(model, factory or optimizer_factory(cfg.optim), cfg.parallel, runtime=runtime,
                          grad_clip=grad_clip, **kwargs)


def windows(seq_len: int):
    """The built-in synthetic language (learnable: losses fall)."""
    from disttrain.config import DataConfig
    from disttrain.data import build_datasets

    return build_datasets(DataConfig(), seq_len)[0]


def batch(windows, index: int, micro: int):
    from disttrain.data import fetch

    return fetch(windows, [(index * micro + i) % len(windows) for i in range(micro)])


def step(backend, windows, index: int, micro: int, accumulate: int = 1) -> dict:
    for i in range(accumulate):
        backend.forward_backward(batch(windows, index * accumulate + i, micro), sync=i == accumulate - 1)
    return backend.optim_step()  # reads the step's totals back: the host waits for the device


def release(device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def state(backend) -> list:
    """The parameters and the optimizer's state, copied (a rank's local shards under FSDP2)."""
    import torch

    from disttrain.parallel.state import local_tensor

    def local(t):
        return local_tensor(t).detach().clone()

    state = [local(t) for s in backend.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return [local(p) for p in backend.model.parameters()] + state


def equal(a: list, b: list) -> bool:
    import torch

    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def max_difference(a: list, b: list) -> float:
    return max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b, strict=True) if x.numel())
