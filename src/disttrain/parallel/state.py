"""Strategy-independent state dicts: keyed by parameter names for a plain module, DDP and FSDP2 alike."""

from __future__ import annotations

from collections.abc import Callable


def full_state_dict_fns(model, sharded: bool = False) -> dict[str, Callable]:
    """state_dict/load_state_dict through torch.distributed.checkpoint.state_dict. `sharded`: each rank's own
    shards (DTensors, saved through DCP); otherwise full tensors on every rank. Loading accepts either form."""

    def state_dict(optimizer):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=not sharded))

    def load_state_dict(optimizer, model_state: dict, optimizer_state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        full = not any(hasattr(t, "to_local") for t in model_state.values())
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state,
                       options=StateDictOptions(full_state_dict=full))

    return {"state_dict": state_dict, "load_state_dict": load_state_dict}
