"""Model registry: `"gpt"` is the reference model, `"hf:DIR"` a local Hugging Face model directory (models/hf.py);
anything else is `"package.module:factory"`."""

from __future__ import annotations

import fnmatch
import importlib
from collections.abc import Callable

from torch import nn

from disttrain.config import ConfigError, ModelConfig


def resolve_factory(name: str) -> Callable[[ModelConfig], nn.Module]:
    """Import `package.module:factory`; a failure is a ConfigError naming `model.name`."""
    if name == "gpt":
        from disttrain.models.gpt import GPT

        return GPT
    if name.startswith("hf:"):
        from disttrain.models.hf import hf_directory, load_pretrained

        hf_directory(name)  # a hub id or a missing directory fails here, before any worker starts
        return lambda cfg: load_pretrained(cfg.name)
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"model.name = {name!r}: cannot import '{module_name}' ({exc}); "
                          "check the module is on PYTHONPATH") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError(f"model.name = {name!r}: '{module_name}' has no callable '{attr}'")
    return factory


def vocab_size(cfg: ModelConfig) -> int:
    """The vocabulary the configured model embeds: an HF directory's config.json says it; else `model.vocab_size`."""
    if cfg.name.startswith("hf:"):
        import json

        from disttrain.models.hf import hf_directory

        return int(json.loads((hf_directory(cfg.name) / "config.json").read_text())["vocab_size"])
    return cfg.vocab_size


def build_model(cfg: ModelConfig) -> nn.Module:
    model = resolve_factory(cfg.name)(cfg)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.name = {cfg.name!r}: the factory returned {type(model).__name__}, "
                          "not a torch.nn.Module")
    return freeze(model, cfg.freeze)


def freeze(model: nn.Module, patterns: str) -> nn.Module:
    """`model.freeze`: the parameters whose names match one of the comma-separated glob `patterns` stop training
    (`requires_grad = False`, before any strategy wraps the model, so that every strategy leaves them out of its
    gradient traffic and the optimizer holds no state for them). A pattern that matches nothing, or patterns that
    match every parameter, are a ConfigError."""
    globs = [p.strip() for p in patterns.split(",") if p.strip()]
    if not globs:
        return model
    named = dict(model.named_parameters(remove_duplicate=False))  # (a tied weight under each of its names)
    for pattern in globs:
        hits = fnmatch.filter(named, pattern)
        if not hits:
            first = next(iter(named), "x.weight")
            raise ConfigError(f"model.freeze: {pattern!r} matches no parameter of the model, whose names read "
                              f"{', '.join(list(named)[:4])}, ...; a pattern matches whole names: e.g. "
                              f"\"{first.rpartition('.')[0] or first}.*\" freezes a module")
        for name in hits:
            named[name].requires_grad_(False)
    if not any(p.requires_grad for p in named.values()):
        raise ConfigError(f"model.freeze = {patterns!r} freezes every parameter of the model: leave some to train")
    return model
