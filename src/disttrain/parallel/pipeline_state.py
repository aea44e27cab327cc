"""A pipeline stage's share of the model's tied weights and state: a tied embedding and head split between the first
and last stage get their gradients summed over a group of those two ranks (`tie_pairs`), a V-shaped schedule's rank
0, which runs both, gives the head a copy of its own (`untie_head`), and each stage saves and loads only its own
parameters under their full-model names (`local_state_fns`), so a checkpoint of any layout loads into any stage.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from disttrain.parallel.stages import Family  # noqa: TC001 (annotations only)
from disttrain.parallel.state import dtensor_targets, full_state_dict_fns


def untie_head(model: nn.Module, fam: Family, ties: list[list[str]]) -> list[tuple[str, str]]:
    """Give each tied weight's name in the head (`fam.head`) a parameter of its own, equal to the embedding's:
    [(embedding name, head name)]. The checkpoint functions still know them as one weight (`ties`)."""
    twins = []
    for group in ties:
        heads = [n for n in group if n.startswith(tuple(f"{m}." for m in fam.head))]
        bodies = [n for n in group if n not in heads]
        for name in heads[:1] if bodies else ():
            owner, _, attr = name.rpartition(".")
            module = model.get_submodule(owner)
            weight = getattr(module, attr)
            setattr(module, attr, nn.Parameter(weight.detach().clone(), requires_grad=weight.requires_grad))
            twins.append((bodies[0], name))
    return twins


def tie_pairs(model, ties, device_mesh, first: bool, last: bool) -> list:
    """Tied weights split between the first and last stage: a group of those two ranks (for each data / tensor
    coordinate) to sum their gradients. Every rank creates every group (torch requires it), in the same order."""
    if not ties:
        return []
    mesh = device_mesh.mesh  # ranks, shape (pp, dp_replicate, dp_shard, tp)
    pairs, mine = [], None
    for coord in itertools.product(*(range(n) for n in mesh.shape[1:])):
        ranks = sorted({int(mesh[(0, *coord)]), int(mesh[(-1, *coord)])})
        group = dist.new_group(ranks) if len(ranks) > 1 else None
        if dist.get_rank() in ranks:
            mine = group
    if mine is None or not (first or last) or (first and last):
        return pairs
    params = dict(model.named_parameters(remove_duplicate=False))
    for group in ties:
        kept = [params[name] for name in group if name in params]
        if kept:
            pairs.append((kept[0], mine))
    return pairs


def local_state_fns(model: nn.Module, ties: list[list[str]]) -> dict[str, Callable]:
    """state_dict / load_state_dict / checkpoint_target for a stage: its own parameters (DTensors or not) with their
    full-model names, saved as its part of a sharded checkpoint; loading reads and takes only those (a tied weight
    from whichever of its names the checkpoint holds), so a checkpoint of any layout loads into any stage."""
    inner = full_state_dict_fns(model, sharded=True)
    held = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    held |= {name for name, _ in model.named_buffers()}
    partners = {name: group for group in ties for name in group}
    wanted = held | {other for name in held for other in partners.get(name, ())}
    target = dtensor_targets(model)

    def own(values: dict) -> dict:
        out = {k: v for k, v in values.items() if k in held and v is not None}
        for name in held - out.keys():  # a tied weight stored under its other name
            source = next((values[o] for o in partners.get(name, ()) if values.get(o) is not None), None)
            if source is not None:  # a copy: two parameters (a V's twins) must never share optimizer state
                out[name] = _cloned(source)
        return out

    def load_state_dict(optimizer, model_state: dict, optimizer_state: dict) -> None:
        groups = [{**g, "params": [n for n in g["params"] if n in held]} for g in optimizer_state["param_groups"]]
        inner["load_state_dict"](optimizer, own(model_state),
                                 {"state": own(optimizer_state["state"]), "param_groups": groups})

    # a tied weight saved under a name this stage does not hold is read like the parameter it holds (e.g. the
    # last stage's head from a checkpoint that stored it as the embedding): sharded the same way
    alias = {other: name for name in held for other in partners.get(name, ()) if other not in held}

    def checkpoint_target(key: str, size, dtype):
        name = _parameter_of(key)
        if name is not None and name not in wanted:
            return None
        if name in alias:
            key = key.replace(name, alias[name], 1)
        return target(key, size, dtype)

    return {"state_dict": inner["state_dict"], "load_state_dict": load_state_dict,
            "checkpoint_target": checkpoint_target}


def _cloned(value):
    """A tensor, or a parameter's optimizer state (a dict of tensors and numbers), with tensors of its own."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    return {k: _cloned(v) for k, v in value.items()} if isinstance(value, dict) else value


def _parameter_of(key: str) -> str | None:
    """The parameter a checkpoint tensor belongs to (None: not a parameter's, e.g. a scaler's state)."""
    if key.startswith("model."):
        return key.removeprefix("model.")
    if key.startswith("optimizer.state."):
        return key.removeprefix("optimizer.state.").rsplit(".", 1)[0]
    return None
