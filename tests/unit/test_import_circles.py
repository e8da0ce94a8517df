"""No import circle in supervisor/: arrows only downward (an import inside a function or
under ``TYPE_CHECKING`` is an arrow too)."""

from __future__ import annotations

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
