"""The strategy registry: name -> `StrategySpec`. Adding a strategy is one module exporting `SPECS` plus one line
in `BUILTIN`; a strategy of your own is `register(spec)` (in every process that uses it: `disttrain verify`
passes the module that defined it to its workers).

The built-in modules are imported on first use, so importing the config does not import torch.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util

from disttrain.errors import ConfigError
from disttrain.parallel.spec import StrategySpec

BUILTIN = (
    "disttrain.parallel.single",
    "disttrain.parallel.ddp",
    "disttrain.parallel.zero",
    "disttrain.parallel.fsdp",
    "disttrain.parallel.deepspeed",  # optional extra: pip install 'disttrain[deepspeed]'
)

AUTO = "auto"
"""`single` on one process, `ddp` on more: resolved once, by `resolve`."""

_specs: dict[str, StrategySpec] = {}


def _load() -> dict[str, StrategySpec]:
    if not _specs:
        for module in BUILTIN:
            for spec in importlib.import_module(module).SPECS:
                _specs.setdefault(spec.name, spec)
    return _specs


def register(spec: StrategySpec) -> None:
    """Make `spec` available by name (replacing one of the same name)."""
    _load()[spec.name] = spec


def names() -> list[str]:
    return list(_load())


def aliases() -> dict[str, str]:
    """Other spellings -> canonical name (e.g. zero3 -> fsdp)."""
    return {alias: spec.name for spec in _load().values() for alias in spec.aliases}


def canonical(name: str) -> str:
    """The strategy's own name for any documented spelling (unknown names are returned unchanged)."""
    return aliases().get(name, name)


def get(name: str) -> StrategySpec:
    specs = _load()
    name = canonical(name)
    if name not in specs:
        close = difflib.get_close_matches(name, [*specs, *aliases(), AUTO], n=1, cutoff=0.5)
        hint = f"did you mean '{close[0]}'?" if close else f"valid names: {', '.join([AUTO, *specs])}"
        raise ConfigError(f"parallel.strategy = {name!r} is not known; {hint}")
    return specs[name]


def resolve(name: str, world_size: int) -> StrategySpec:
    """The spec for `name`, with `auto` resolved for `world_size`."""
    if name == AUTO:
        name = "single" if world_size == 1 else "ddp"
    return get(name)


def available(spec: StrategySpec) -> bool:
    """Whether its optional package (if any) is installed."""
    return not spec.package or importlib.util.find_spec(spec.package) is not None


def option_users() -> dict[str, list[str]]:
    """Strategy-specific setting -> the strategies that read it."""
    users: dict[str, list[str]] = {}
    for spec in _load().values():
        for option in sorted(spec.options):
            users.setdefault(option, []).append(spec.name)
    return users


def check_options(spec: StrategySpec, p, defaults) -> None:
    """A strategy-specific setting that `spec` does not read, set away from its default (`defaults`), is a mistake:
    it would silently do nothing."""
    for option, users in option_users().items():
        value = getattr(p, option)
        if option in spec.options or value == getattr(defaults, option):
            continue
        shown = str(value).lower() if isinstance(value, bool) else repr(value)
        fix = f"set parallel.strategy = '{users[0]}'" if len(users) == 1 else "set parallel.strategy to one of them"
        raise ConfigError(f"parallel.{option} = {shown} needs a strategy that uses it ({', '.join(users)}), not "
                          f"{spec.name!r}; {fix} or remove parallel.{option}")
