"""The controller is one-way: what it changes, it changes in one place. Read from the
source with ``ast`` (every assignment and call counts, wherever it is): the supervisor's
state, the event log's attempt label and the read model's round each have one writer,
inside the transition step; the serving and watchdog wiring never reach through the
controller for their collaborators."""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable

from tests.support.paths import REPO

SUPERVISOR = REPO / "supervisor"


@functools.cache
def _nodes() -> tuple[tuple[str, ast.AST], ...]:
    """Every node of ``supervisor/`` with the ``module:function`` it is in (its innermost
    function or method; ``module:`` at module level), each source parsed once."""
    found: list[tuple[str, ast.AST]] = []

    def walk(node: ast.AST, where: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                walk(child, where, f"{prefix}{child.name}.")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                found.append((f"{where.split(':')[0]}:{name}", child))
                walk(child, f"{where.split(':')[0]}:{name}", name + ".")
            else:
                found.append((where, child))
                walk(child, where, prefix)

    for path in sorted(SUPERVISOR.rglob("*.py")):
        module = path.relative_to(SUPERVISOR).with_suffix("").as_posix()
        walk(ast.parse(path.read_text()), f"{module}:", "")
    return tuple(found)


def _functions(tree: ast.Module) -> dict[str, ast.AST]:
    """The functions and methods of ``tree`` by qualified name."""
    found: dict[str, ast.AST] = {}

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                if not isinstance(child, ast.ClassDef):
                    found[f"{prefix}{child.name}"] = child
                walk(child, f"{prefix}{child.name}.")

    walk(tree, "")
    return found


def _where(match: type[ast.AST], test: Callable[[ast.AST], bool]) -> set[str]:
    """``module:function`` of every node of type ``match`` for which ``test(node)``."""
    return {where for where, node in _nodes() if isinstance(node, match) and test(node)}


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return node.targets
    if isinstance(node, ast.AugAssign | ast.AnnAssign):
        return [node.target]
    return []


def _assigns(attr: str, owner: str) -> Callable[[ast.AST], bool]:
    """A test for an assignment to ``<...>.<owner>.<attr>`` or ``<owner>.<attr>``."""

    def test(node: ast.AST) -> bool:
        for target in _targets(node):
            if isinstance(target, ast.Attribute) and target.attr == attr:
                value = target.value
                if isinstance(value, ast.Attribute) and value.attr == owner:
                    return True
                if isinstance(value, ast.Name) and value.id == owner:
                    return True
        return False

    return test


def _calls(attr: str) -> Callable[[ast.AST], bool]:
    def test(node: ast.AST) -> bool:
        return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == attr)

    return test


def test_the_event_logs_attempt_label_has_one_writer() -> None:
    writers = _where(ast.stmt, _assigns("attempt", "events"))
    assert writers == {"controller:Controller._label_events"}


def test_the_event_logs_attempt_label_is_set_in_the_transition_step_and_the_launch() -> None:
    callers = _where(ast.Call, _calls("_label_events"))
    assert callers == {"controller:Controller._apply", "controller:Controller._launch"}


def test_the_read_model_hears_of_a_round_only_inside_a_transition() -> None:
    assert _where(ast.Call, _calls("on_round")) == {"controller:Controller._apply"}


def test_the_controllers_state_and_round_are_written_only_by_the_transition_step() -> None:
    state = _where(ast.stmt, _assigns("state", "self"))
    assert {w for w in state if w.startswith("controller:")} == {
        "controller:Controller.__init__", "controller:Controller._apply"}
    rounds = _where(ast.stmt, _assigns("round", "self"))
    assert {w for w in rounds if w.startswith("controller:")} == {
        "controller:Controller.__init__", "controller:Controller._apply"}


def test_serving_and_the_watchdog_are_handed_their_collaborators() -> None:
    """No ``controller.X`` inside the serving module or the watchdog's factory: what they
    use is given to them when they are made."""
    tree = ast.parse((SUPERVISOR / "serving.py").read_text())
    reached = [n for n in ast.walk(tree)
               if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
               and n.value.id == "controller"]
    assert reached == []
    app = _functions(ast.parse((SUPERVISOR / "wiring.py").read_text()))
    watchdog = app["make_watchdog"]
    assert isinstance(watchdog, ast.FunctionDef)
    assert "controller" not in {a.arg for a in watchdog.args.args}
