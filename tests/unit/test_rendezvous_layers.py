"""``supervisor/rendezvous/`` is layered, arrows only downward (like the core's purity
test): the etcd wire at the bottom imports nothing above it, the base names no backend,
the parts of the etcd backend never reach its facade, and only the registry names every
backend. An import inside a function or under ``TYPE_CHECKING`` is an arrow too."""

from __future__ import annotations

import functools

from tests.support.importgraph import import_graph
from tests.support.paths import REPO

PKG = "supervisor.rendezvous"

# Every module of the package belongs to one layer (the longest prefix wins); a layer
# may import only the layers named here (itself included).
LAYERS: dict[str, str] = {
    "etcd.wire": "the etcd client: its requests, watch streams and the decoding of values",
    "base": "the protocol and the small service protocols, naming no backend",
    "conf": "--rdzv-conf parsing, shared by the backends",
    "etcd.config": "the etcd backend's settings (the registry makes them)",
    "etcd": "the etcd backend's parts, one job each",
    "etcd.backend": "the etcd backend's facade",
    "local_health": "the static backend's node records, in memory",
    "static": "the embedded single-node backend",
    "c10d": "etcd hosted by one supervisor",
    "registry": "the backends by name",
    "watch": "the controller's membership watch",
}
MAY_IMPORT: dict[str, set[str]] = {
    "etcd.wire": {"etcd.wire"},
    "base": {"base"},
    "conf": {"conf"},
    "etcd.config": {"etcd.config", "etcd.wire", "conf"},
    "etcd": {"etcd", "etcd.config", "etcd.wire", "base", "conf"},
    "etcd.backend": {"etcd", "etcd.config", "etcd.wire", "base", "conf"},
    "local_health": {"local_health"},
    "static": {"static", "local_health", "base"},
    "c10d": {"c10d", "etcd.backend", "etcd.config", "etcd", "etcd.wire", "base", "conf",
             "static"},
    "registry": {"c10d", "etcd.backend", "etcd.config", "static", "base", "conf"},
    "watch": {"base"},
}
# what the wire and the base may import from the rest of supervisor/: what lies below
# every layer (the pure core, the shared errors)
BELOW_ALL = ("supervisor.core.", "supervisor.errors")


def layer_of(module: str) -> str:
    name = module.removeprefix(PKG + ".")
    found = [layer for layer in LAYERS if name == layer or name.startswith(layer + ".")]
    return max(found, key=len) if found else ""


@functools.cache
def _graph() -> dict[str, set[str]]:
    return import_graph(REPO / "supervisor")


def _ours(graph: dict[str, set[str]]) -> list[str]:
    packages = {PKG, PKG + ".etcd", PKG + ".etcd.wire", PKG + ".c10d"}  # docstrings only
    return [m for m in sorted(graph) if m.startswith(PKG + ".") and m not in packages]


def test_every_module_of_the_package_has_a_layer() -> None:
    assert [m for m in _ours(_graph()) if not layer_of(m)] == []


def upward_arrows(graph: dict[str, set[str]]) -> list[str]:
    return [f"{m} ({layer_of(m)}) -> {t} ({layer_of(t)})"
            for m in _ours(graph) for t in sorted(graph[m])
            if t.startswith(PKG + ".") and layer_of(t) not in MAY_IMPORT[layer_of(m)]]


def test_arrows_point_only_to_the_layers_allowed() -> None:
    assert upward_arrows(_graph()) == []


def test_an_arrow_up_is_found() -> None:
    # the check above is only as good as its rules: these arrows would break the layers
    graph = {name: set(targets) for name, targets in _graph().items()}
    graph[PKG + ".etcd.wire.client"].add(PKG + ".etcd.keys")  # the wire reads round logic
    graph[PKG + ".base"].add(PKG + ".etcd.config")  # the base names a backend
    graph[PKG + ".registry"].add(PKG + ".etcd.rounds")  # past the facade
    graph[PKG + ".etcd.keys"].add(PKG + ".etcd.backend")  # a part reaches its facade
    graph[PKG + ".static"].add(PKG + ".registry")
    assert upward_arrows(graph) == [
        f"{PKG}.base (base) -> {PKG}.etcd.config (etcd.config)",
        f"{PKG}.etcd.keys (etcd) -> {PKG}.etcd.backend (etcd.backend)",
        f"{PKG}.etcd.wire.client (etcd.wire) -> {PKG}.etcd.keys (etcd)",
        f"{PKG}.registry (registry) -> {PKG}.etcd.rounds (etcd)",
        f"{PKG}.static (static) -> {PKG}.registry (registry)",
    ]


def test_the_wire_and_the_base_import_only_what_lies_below_everything() -> None:
    graph = _graph()
    wrong = [f"{m} -> {t}" for m in _ours(graph) if layer_of(m) in ("etcd.wire", "base", "conf")
             for t in sorted(graph[m])
             if not t.startswith(PKG + ".") and not t.startswith(BELOW_ALL)]
    assert wrong == []


def test_the_packages_re_export_nothing() -> None:
    # importing the wire (statuscmd, nodecmd) must not import the backend through a parent
    graph = _graph()
    assert {p: graph[p] for p in (PKG, PKG + ".etcd", PKG + ".etcd.wire", PKG + ".c10d")} == {
        PKG: set(), PKG + ".etcd": set(), PKG + ".etcd.wire": set(), PKG + ".c10d": set()}


def test_a_layer_is_the_longest_prefix() -> None:
    assert layer_of(PKG + ".etcd.wire.client") == "etcd.wire"
    assert layer_of(PKG + ".etcd.backend") == "etcd.backend"
    assert layer_of(PKG + ".etcd.keys") == "etcd"
    assert layer_of(PKG + ".c10d.access") == "c10d"
    assert layer_of(PKG + ".etcdx") == ""  # a prefix of a name is no layer
