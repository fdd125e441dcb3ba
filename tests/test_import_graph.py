"""The package's import graph, read from the source: no circle of modules, no two folders importing each other.

Every ``import`` statement of every module under ``jaxscale/`` counts, at module level or inside a function
(an import deferred into a function is still an import). A folder is a subpackage (``models/``,
``parallel/``, ``analysis/``); the modules directly under ``jaxscale/`` span every floor, so they count as
modules in the circle check, not as one folder.
"""

from __future__ import annotations

import ast
import functools
from importlib.util import resolve_name
from pathlib import Path

import jaxscale

PACKAGE = Path(jaxscale.__file__).resolve().parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """Each module of the package -> the package's modules it imports."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = resolve_name("." * node.level + (node.module or ""), package) if node.level else node.module
                targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def folder(module: str) -> str | None:
    """The subpackage a module lives in (``jaxscale.models``), None for the modules directly under jaxscale/."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or (PACKAGE / parts[-1]).is_dir() else None


def test_the_reader_sees_known_edges():
    graph = import_graph()
    assert "jaxscale.parallel.ring_attention" in graph["jaxscale.models.attention"]  # from jaxscale.parallel import x
    assert "jaxscale.config.read" in graph["jaxscale.layout.rules"]  # from jaxscale.config.read import names
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circles():
    assert circles(import_graph()) == []


def test_no_two_folders_import_each_other():
    pairs = {(folder(a), folder(b)) for a, targets in import_graph().items() for b in targets}
    pairs = {(a, b) for a, b in pairs if a and b and a != b}
    assert sorted((a, b) for a, b in pairs if (b, a) in pairs) == []
