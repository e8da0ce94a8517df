"""The import graph of a package, read with ``ast``, and its circles.

    python -m tests.support.importgraph    # prints supervisor/'s circles, if any

Every import is an arrow: at module level, inside a function, under ``TYPE_CHECKING``.
``from pkg import name`` points at ``pkg.name`` when that is a module, else at ``pkg``;
relative imports are resolved against the importing module. A package's ``__init__`` is a
node like any module; importing ``a.b.c`` is an arrow to ``a.b.c`` alone (the parents it
runs first are not counted, so a package's ``__init__`` may re-export its modules).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def module_names(root: Path) -> dict[str, Path]:
    """Dotted name -> file, for every ``.py`` under the package directory ``root``."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    anchor = package[: len(package) - (node.level - 1)]
    return ".".join(anchor + ([node.module] if node.module else []))


def _targets(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, is_package, node)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    # A module run as ``__main__`` may import itself by its canonical name (the bootstrap
    # does): that runs it once more, it is no circle between modules.
    return {name for name in found if name in known and name != module}


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports, anywhere in its text."""
    known = module_names(root)
    return {module: _targets(module, path, known) for module, path in known.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components that hold a circle (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for node in sorted(graph):
            if node not in index:
                visit(node)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(found)


def one_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A concrete path a -> b -> ... -> a inside ``component``, for a readable report."""
    members = set(component)
    start = component[0]
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        node = frontier.pop(0)
        for nxt in sorted(graph[node] & members):
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(parents[path[-1]])
                return [*reversed(path), start]
            if nxt not in parents:
                parents[nxt] = node
                frontier.append(nxt)
    return component


if __name__ == "__main__":
    from tests.support.paths import REPO

    graph = import_graph(REPO / "supervisor")
    for component in circles(graph):
        print(f"{len(component)} modules: {' -> '.join(one_cycle(graph, component))}")
        print("   all: " + ", ".join(component))
