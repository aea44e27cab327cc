"""The settings read back from their sections' source: every key's type, default and docstring (`describe()`), for
`config --list`, the README table and docs/config.md."""

from __future__ import annotations

import ast
import inspect
from typing import Any

from disttrain.config.sections import SECTIONS, field_types
from disttrain.parallel import registry


def describe() -> list[tuple[str, str, Any, str]]:
    """(dotted key, type, default, docstring) for every setting, read from the source docstrings; the strategy
    names, and which strategies read each strategy-specific setting, come from the strategy registry."""
    users = registry.option_users()
    rows = []
    for section, cls in SECTIONS.items():
        docs = _field_docstrings(cls)
        defaults = cls()
        for name, typ in field_types(cls).items():
            doc = docs.get(name, "")
            if section == "parallel" and name == "strategy":
                doc += " " + "; ".join(f"`{spec.name}`: {spec.summary}" + (
                    f" (alias {', '.join(spec.aliases)})" if spec.aliases else "") + (
                    f" (`pip install 'disttrain[{spec.package}]'`)" if spec.package else "")
                    for spec in map(registry.get, registry.names())) + "."
            elif section == "parallel" and name in users:
                doc += f" Read by: {', '.join(users[name])}."
            rows.append((f"{section}.{name}", typ.__name__, getattr(defaults, name), doc))
    return rows


def _field_docstrings(cls: type) -> dict[str, str]:
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs
