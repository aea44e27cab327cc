"""Strategy-independent state dicts: keyed by parameter names for a plain module, DDP and FSDP2 alike."""

from __future__ import annotations

from collections.abc import Callable


def local_tensor(t):
    """This rank's part of a DTensor (read by its method: importing DTensor costs start-up), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def parameter_names(model) -> dict[int, list[str]]:
    """id(parameter) -> every name it has in `model`, in module order (several for tied parameters)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return names


def tie_groups(model) -> list[list[str]]:
    """Names of each parameter shared by several modules (tied embeddings), first name first."""
    return [group for group in parameter_names(model).values() if len(group) > 1]


def full_state_dict_fns(model, sharded: bool = False) -> dict[str, Callable]:
    """state_dict/load_state_dict through torch.distributed.checkpoint.state_dict. `sharded`: each rank's own
    shards (DTensors, saved through DCP); otherwise full tensors on every rank. Loading accepts either form."""

    def state_dict(optimizer):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        model_state, optimizer_state = get_state_dict(model, optimizer,
                                                      options=StateDictOptions(full_state_dict=not sharded))
        return share_tied(model, model_state), optimizer_state

    def load_state_dict(optimizer, model_state: dict, optimizer_state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

        options = StateDictOptions(full_state_dict=not any(hasattr(t, "to_local") for t in model_state.values()))
        optimizer_state = canonical_names(model, optimizer_state)
        groups, saved = optimizer.param_groups, optimizer_state["param_groups"]
        empty = [i for i, group in enumerate(groups) if not group["params"]]
        if not empty or len(saved) != len(groups) or any(saved[i]["params"] for i in empty):  # (torch: what differs)
            set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state,
                           options=options)
            return
        # torch's set_state_dict places at most one empty group, and none where nothing else is: the empty groups
        # (a model.freeze that empties one, a stage with nothing to train) stand aside and take their saved settings
        optimizer.param_groups = [group for i, group in enumerate(groups) if i not in empty]
        try:
            if optimizer.param_groups:
                kept = {**optimizer_state, "param_groups": [g for i, g in enumerate(saved) if i not in empty]}
                set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=kept, options=options)
            else:
                set_model_state_dict(model, model_state, options=options)
        finally:
            loaded = iter(optimizer.param_groups)  # (a load replaces the group dicts)
            optimizer.param_groups = [{**groups[i], **{k: v for k, v in saved[i].items() if k != "params"}}
                                      if i in empty else next(loaded) for i in range(len(groups))]

    return {"state_dict": state_dict, "load_state_dict": load_state_dict}


def canonical_names(model, optimizer_state: dict) -> dict:
    """An optimizer state keyed by parameter names, with a tied parameter under the one name this model's optimizer
    uses (its first): a state saved under a pipeline holds it under both (the first and last stage each keep one)."""
    first = {name: names[0] for names in parameter_names(model).values() for name in names}
    state = {}
    for name, value in optimizer_state.get("state", {}).items():
        state.setdefault(first.get(name, name), value)
    groups = [{**g, "params": list(dict.fromkeys(first.get(n, n) for n in g["params"]))}
              for g in optimizer_state.get("param_groups", [])]
    return {**optimizer_state, "state": state, "param_groups": groups}


def share_tied(model, model_state: dict) -> dict:
    """Tied parameters (one Parameter under several names, e.g. a tied embedding and LM head) as one object in
    the state dict, as they are one in the model. get_state_dict returns a DTensor per name, which checkpoints
    would store twice and an export could not tell apart from two weights; one object is stored once (the
    checkpoint's skeleton points both names at it), on every rank alike since it follows the module tree."""
    for group in tie_groups(model):
        present = [name for name in group if name in model_state]
        for name in present[1:]:
            model_state[name] = model_state[present[0]]
    return model_state


def dtensor_targets(model):
    """For a DCP checkpoint: each saved tensor (key, global size, dtype) is loaded into an empty tensor laid out like
    the parameter it belongs to (a DTensor receives only its shard), optimizer moments like their parameter (same
    global shape), anything else (steps, scalars) in full."""
    import torch

    params = dict(model.named_parameters(remove_duplicate=False))  # tied weights under each name

    def target(key: str, size, dtype):
        name = key.removeprefix("model.")
        if key.startswith("optimizer.state."):
            name = key.removeprefix("optimizer.state.").rsplit(".", 1)[0]
        param = params.get(name)
        if param is not None and tuple(param.shape) == tuple(size) and hasattr(param, "to_local"):
            return torch.empty_like(param, dtype=dtype)
        return torch.empty(size, dtype=dtype)

    return target
