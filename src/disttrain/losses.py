"""Token-summed language-model losses, in the two label conventions.

- `lm_loss`: labels already shifted (label t is the target of position t): disttrain's own token windows.
- `causal_lm_loss`: Hugging Face's convention, labels aligned with `input_ids` (often `labels = input_ids`); the
  loss shifts them, so position t predicts label t + 1, as `model(input_ids, labels=labels).loss` does.

Both return (summed cross-entropy, number of non-padding targets): the backend divides the gradient of the
sum by the global count once per step, so micro-batching, padding and world size never change it (HF's mean
loss per micro-batch would). Model outputs may be logits, a `ModelOutput` (its `logits`), a dict or a tuple
(the first item). `default_loss(model)` picks HF's convention for a transformers model, disttrain's otherwise.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from disttrain.data import IGNORE_INDEX
from disttrain.errors import ConfigError
from disttrain.models.hf import is_hf_model


def cut_logits(outputs: Any, width: int) -> Any:
    """`outputs` with its logits (a tensor, an output's `logits` field, changed in place, or a tuple's first) cut to
    their first `width` positions."""
    if isinstance(outputs, torch.Tensor):
        return outputs[:, :width]
    if isinstance(outputs, dict) and isinstance(outputs.get("logits"), torch.Tensor):
        outputs["logits"] = outputs["logits"][:, :width]
    elif isinstance(outputs, (tuple, list)) and outputs and isinstance(outputs[0], torch.Tensor):
        return type(outputs)([outputs[0][:, :width], *outputs[1:]])
    return outputs


def logits_of(outputs: Any) -> torch.Tensor:
    if isinstance(outputs, torch.Tensor):
        return outputs
    logits = getattr(outputs, "logits", None)
    if logits is None and isinstance(outputs, dict):
        logits = outputs.get("logits")
    if logits is None and isinstance(outputs, (tuple, list)) and outputs:
        logits = outputs[0]
    if not isinstance(logits, torch.Tensor):
        raise ConfigError(f"the model returned {type(outputs).__name__} without logits; return logits (or an "
                          "output with a `logits` field), or pass a loss_fn that reads your model's output")
    return logits


def _token_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if labels.shape != logits.shape[:-1]:
        raise ConfigError(f"data: labels of shape {list(labels.shape)} do not match the inputs (logits for "
                          f"{list(logits.shape[:-1])} tokens); give one label per input token, -100 for padding")
    loss = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")
    if hasattr(loss, "to_local"):  # a DTensor: logits split by vocabulary (loss parallel), every rank has the sum
        loss = loss.to_local()  # (read by its method: importing DTensor costs a worker ~0.6 s of start-up)
    return loss, (labels != IGNORE_INDEX).sum()


def lm_loss(outputs: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy for pre-shifted labels, and the number of non-padding labels."""
    return _token_sum(logits_of(outputs), batch["labels"])


def causal_lm_loss(outputs: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy for labels aligned with the inputs (HF's convention: shifted here)."""
    logits, labels = logits_of(outputs), batch["labels"]
    if labels.shape != logits.shape[:-1]:
        return _token_sum(logits, labels)  # the one-line error
    return _token_sum(logits[:, :-1], labels[:, 1:])


def shifted(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`batch` with HF's labels turned into pre-shifted ones (label t is the target of position t; the last
    position has none), for `lm_loss`: what a sequence cut into pieces needs (context parallelism)."""
    labels = batch["labels"]
    return {**batch, "labels": torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)}


def takes_split_logits(loss_fn) -> bool:
    """Whether `loss_fn` takes logits split by vocabulary across tensor-parallel ranks (a DTensor, under torch's
    loss_parallel: parallel/tensor.py): disttrain's own losses do; any other is given whole logits."""
    return loss_fn in (lm_loss, causal_lm_loss)


def default_loss(model: nn.Module):
    """HF's label convention for a transformers model, disttrain's pre-shifted one for anything else."""
    return causal_lm_loss if is_hf_model(model) else lm_loss
