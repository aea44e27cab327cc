"""Loading a configuration: the defaults, over them a TOML, YAML or JSON file, over that the `dist` section from the
environment (`DISTTRAIN_DIST_*`), over all the dotted `--set section.key=value` overrides, each value coerced to its
field's type; and writing one back as TOML."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

from disttrain.config.sections import CHOICES, SECTIONS, Config, DistConfig, field_types, suggest
from disttrain.errors import ConfigError
from disttrain.parallel import registry
from disttrain.precision import canonical_precision


def _coerce(key: str, value: Any, typ: type) -> Any:
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif typ is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        if isinstance(value, bool) and "true" in CHOICES.get(key, ()):  # auto | true | false settings
            return str(value).lower()
    raise ConfigError(f"{key} = {value!r}: expected {typ.__name__}; fix the value in the config or --set")


def set_value(cfg: Config, dotted: str, value: Any) -> None:
    """Set `section.key` on `cfg`, checking the names and coercing the value to the field's type; an
    accepted alias (e.g. a precision's) becomes its canonical name here."""
    section, _, key = dotted.partition(".")
    if section not in SECTIONS or not key:
        raise ConfigError(f"unknown setting '{dotted}': {suggest(section, list(SECTIONS))}")
    types = field_types(SECTIONS[section])
    if key not in types:
        names = list(types)
        raise ConfigError(f"unknown setting '{dotted}': {suggest(key, names)} (section [{section}])")
    value = _coerce(dotted, value, types[key])
    if dotted == "parallel.strategy":
        value = registry.canonical(value)  # documented aliases (zero3 -> fsdp) become the one name here
    if dotted == "parallel.precision":
        value = canonical_precision(value)  # Fabric's and Accelerate's spellings become the one name here
    setattr(getattr(cfg, section), key, value)


def _parse_override(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. --set optim.lr=1e-3")
    key, raw = (part.strip() for part in text.split("=", 1))
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # bare words are strings: --set model.name=gpt
    return key, value


GPU_BOUND_ENV = "DISTTRAIN_GPU_BOUND"
"""Set to 1 by the Ray launchers for an actor Ray gave GPUs of its own (it sees only those): the rank is bound to
GPU 0 of what it sees, whatever its local rank (runtime.pick_device)."""


NODE_CLAIM_ENV = "DISTTRAIN_NODE_CLAIM"
"""Set by disttrain's launcher for its workers on a multi-node job: `NODE_RANK@RDZV_ENDPOINT`, the --node-rank this
node was given (runtime.py checks that no two nodes were given the same one)."""


ENV_PREFIX = "DISTTRAIN_DIST_"
"""`dist.<key>` from the environment: DISTTRAIN_DIST_NPROC=2, DISTTRAIN_DIST_BACKEND=gloo, ..."""


def to_env(dist: DistConfig) -> dict[str, str]:
    """The dist section as environment variables (`from_env` reads them back): for a subprocess or a job script."""
    values = {f.name: getattr(dist, f.name) for f in dataclasses.fields(dist)}
    return {ENV_PREFIX + k.upper(): v if isinstance(v, str) else _toml_value(v) for k, v in values.items()}


def from_env(environ: Mapping[str, str] | None = None, dist: DistConfig | None = None) -> DistConfig:
    """`dist` (default: the defaults) with every DISTTRAIN_DIST_* variable of `environ` applied; an unknown name
    or a value of the wrong type is a one-line ConfigError."""
    cfg = Config(dist=dist or DistConfig())
    environ = os.environ if environ is None else environ
    for name in sorted(k for k in environ if k.startswith(ENV_PREFIX)):
        key = name[len(ENV_PREFIX):].lower()
        if key not in field_types(DistConfig):
            raise ConfigError(f"environment variable {name}: no setting dist.{key}; "
                              f"{suggest(key, list(field_types(DistConfig)))} (or unset it)")
        try:
            set_value(cfg, f"dist.{key}", _parse_override(f"dist.{key}={environ[name]}")[1])
        except ConfigError as exc:
            raise ConfigError(f"environment variable {name}={environ[name]!r}: {str(exc).split(': ', 1)[-1]}; "
                              "fix or unset it") from None
    return cfg.dist


def _read_file(path: Path) -> dict[str, Any]:
    """A config file's sections as a dict: TOML, YAML (.yaml/.yml, needs PyYAML) or JSON, by its suffix."""
    suffix = path.suffix.lower()
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError(f"config file '{path}': cannot read it ({reason}); give a TOML, YAML or JSON file") from None
    if suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ConfigError(f"config file '{path}' is YAML, which needs PyYAML: pip install 'disttrain[yaml]' "
                              "(or write it as TOML or JSON)") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ConfigError(f"config file '{path}' is not valid YAML ({where}{problem}); fix the syntax") from None
        kind = "YAML"
    elif suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config file '{path}' is not valid JSON ({exc}); fix the syntax") from None
        kind = "JSON"
    else:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file '{path}' is not valid TOML ({exc}); fix the syntax") from None
        kind = "TOML"
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}': the top level of the {kind} must be a mapping of sections "
                          "(run:, model:, ...), not a list or a value")
    return data


def load_config(path: str | os.PathLike | None = None, overrides: list[str] = (),
                environ: Mapping[str, str] | None = None) -> Config:
    """Defaults, then the config file (TOML, YAML or JSON, if any), then DISTTRAIN_DIST_* environment variables
    (`from_env`), then `--set section.key=value` overrides: `--set` > environment > file > defaults."""
    cfg = Config()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file '{path}' does not exist; pass an existing TOML, YAML or JSON file")
        for section, values in _read_file(path).items():
            if not isinstance(values, dict):
                raise ConfigError(
                    f"'{section}' in {path}: settings belong in sections, e.g. [{section}]; "
                    f"{suggest(section, list(SECTIONS))}"
                )
            for key, value in values.items():
                set_value(cfg, f"{section}.{key}", value)
    cfg.dist = from_env(environ, cfg.dist)
    for text in overrides:
        set_value(cfg, *_parse_override(text))
    return cfg


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ("nan" if math.isnan(value) else
                                                         ("inf" if value > 0 else "-inf"))
    if isinstance(value, int):
        return str(value)
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


def dumps_toml(cfg: Config) -> str:
    lines = []
    for section, values in cfg.to_dict().items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in values.items()]
        lines.append("")
    return "\n".join(lines)


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    """Write the fully resolved config atomically (temp file + rename). The temp file is this process's own: the
    nodes of a multi-node job may write the same run folder (shared storage, or one machine) at the same moment."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(dumps_toml(cfg))
    os.replace(tmp, path)
