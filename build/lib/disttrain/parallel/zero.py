"""`zero1`: DDP for the gradients plus torch's ZeroRedundancyOptimizer, which shards the optimizer state
(each rank keeps and updates the state of its share of the parameters, then broadcasts them).

Checkpoints use the same full, parameter-name-keyed state as every other strategy: the optimizer state is
consolidated on rank 0 and renamed from ZeRO's parameter indices to parameter names (and back on load).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from disttrain.parallel import ddp as ddp_strategy
from disttrain.parallel import layout
from disttrain.parallel.spec import Prepared, StrategySpec, optimizer_kwargs

if TYPE_CHECKING:
    from torch import nn


def apply(model: nn.Module, runtime, cfg) -> Prepared:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.optim import ZeroRedundancyOptimizer

    prepared = ddp_strategy.apply(model, runtime, cfg)
    names = {param: name for name, param in model.named_parameters()}
    order: list = []  # ZeRO's global parameter order (its state_dict keys are indices into it)

    def make_optimizer(factory):
        inner = factory(model)  # the user's optimizer, used for its class, groups and defaults only
        groups = [dict(group) for group in inner.param_groups]
        order.extend(p for group in groups for p in group["params"])
        return ZeroRedundancyOptimizer(groups, optimizer_class=type(inner), **optimizer_kwargs(inner))

    def state_dict(optimizer):
        optimizer.consolidate_state_dict(to=0)  # collective; only rank 0 receives (and saves) the state
        if runtime.rank != 0:
            return get_model_state_dict(model), {}
        raw = optimizer.state_dict()
        return get_model_state_dict(model), {
            "state": {names[order[i]]: value for i, value in raw["state"].items()},
            "param_groups": [{**g, "params": [names[order[i]] for i in g["params"]]} for g in raw["param_groups"]],
        }

    def load_state_dict(optimizer, model_state, optimizer_state):
        set_model_state_dict(model, model_state)
        index = {names[p]: i for i, p in enumerate(order)}
        optimizer.load_state_dict({
            "state": {index[name]: value for name, value in optimizer_state["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in optimizer_state["param_groups"]],
        })

    prepared.make_optimizer = make_optimizer
    prepared.state_dict, prepared.load_state_dict = state_dict, load_state_dict
    return prepared


def memory(shapes, cfg, world: int, rank: int | None) -> layout.MemoryLayout:
    return ddp_strategy.with_buckets(layout.zero1(shapes, cfg, world, rank), cfg, world)  # DDP carries the grads


SPECS = (StrategySpec("zero1", apply, "DDP + ZeroRedundancyOptimizer: optimizer state sharded", memory,
                      options=ddp_strategy.OPTIONS, check=ddp_strategy.check),)
