"""No import circle in supervisor/: arrows only downward (an import inside a function or
under ``TYPE_CHECKING`` is an arrow too)."""

from __future__ import annotations

from pathlib import Path

from tests.support.importgraph import circles, import_graph, one_cycle
from tests.support.paths import REPO


def test_supervisor_has_no_import_circle() -> None:
    graph = import_graph(REPO / "supervisor")
    found = [f"{len(c)} modules: {' -> '.join(one_cycle(graph, c))} (all: {', '.join(c)})"
             for c in circles(graph)]
    assert found == []


def test_the_graph_sees_every_kind_of_arrow() -> None:
    # the check above is only as good as the graph: these arrows are in the code today
    graph = import_graph(REPO / "supervisor")
    assert "supervisor.core.state" in graph["supervisor.workers.group"]  # from pkg import mod
    assert "supervisor.api" in graph["supervisor"]  # inside a function, and TYPE_CHECKING
    assert len(graph) > 50


def test_a_circle_is_reported_with_its_modules() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert one_cycle(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]


def test_relative_imports_and_submodules_are_resolved(tmp_path: Path) -> None:
    sources = {
        "__init__.py": "",
        "a.py": "from . import b\nfrom .sub import c\nimport os\n",
        "b.py": "def f() -> None:\n    from pkg.sub.c import X\n",
        "sub/__init__.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                           "    from .. import a\n",
        "sub/c.py": "X = 1\n",
    }
    for name, text in sources.items():
        (tmp_path / "pkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / name).write_text(text)
    graph = import_graph(tmp_path / "pkg")
    assert graph["pkg.a"] == {"pkg.b", "pkg.sub.c"}  # os is not ours
    assert graph["pkg.b"] == {"pkg.sub.c"}  # inside a function, a name of the module
    assert graph["pkg.sub"] == {"pkg.a"}  # TYPE_CHECKING, two dots
    # importing pkg.sub.c runs pkg/sub/__init__ first, but that is not counted as an arrow
    assert circles(graph) == []
