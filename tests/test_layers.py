"""The import graph of src/disttrain, module-level and function-local imports alike (TYPE_CHECKING blocks aside):
no cycle, and no import from a lower layer to a higher one, in the layer order that docs/architecture.md writes
down (its ```layers block). A module belongs to the longest name in that block that it equals or lies under."""

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src" / "disttrain"


def layer_order() -> dict[str, int]:
    text = (REPO / "docs" / "architecture.md").read_text()
    block = re.search(r"```layers\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md has no ```layers block"
    order = {}
    for line in block.group(1).splitlines():
        number, _, names = line.strip().partition(" ")
        for name in names.split("#")[0].replace(",", " ").split():
            order[name] = int(number)
    return order


def modules() -> dict[str, Path]:
    found = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _type_checking_lines(tree: ast.AST) -> set[int]:
    blocks = [node for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)]
    return {inner.lineno for node in blocks for stmt in node.body for inner in ast.walk(stmt)
            if hasattr(inner, "lineno")}


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules `name` imports (a `from pkg import sub` counts `pkg.sub` when that is a module)."""
    tree = ast.parse(path.read_text())
    skip, package = _type_checking_lines(tree), name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or node.lineno in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        for target in targets:
            while target not in known and "." in target:
                target = target.rpartition(".")[0]
            if target in known and target != name:
                out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def layer_of(module: str, order: dict[str, int]) -> int:
    relative = module.removeprefix("disttrain").lstrip(".") or "disttrain"
    matches = [name for name in order if relative == name or relative.startswith(name + ".")]
    assert matches, f"{module} is in no layer of docs/architecture.md's ```layers block: add it there"
    return order[max(matches, key=len)]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    assert cycles(graph()) == []


def test_no_import_from_a_lower_layer_to_a_higher_one():
    order, edges = layer_order(), graph()
    upward = [f"{a} (layer {layer_of(a, order)}) imports {b} (layer {layer_of(b, order)})"
              for a, targets in edges.items() for b in targets if layer_of(b, order) > layer_of(a, order)]
    assert upward == []


def test_the_checker_sees_function_local_imports_and_cycles():
    """cli.main imports launch only inside functions, and a two-module loop is a cycle: the checks can fail."""
    main = (SRC / "cli" / "main.py").read_text()
    assert "\nfrom disttrain.launch" not in main and "    from disttrain.launch import launch" in main
    assert "disttrain.launch" in graph()["disttrain.cli.main"]
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert layer_of("disttrain.checkpoint.statefile", layer_order()) < layer_of("disttrain.checkpoint", layer_order())
