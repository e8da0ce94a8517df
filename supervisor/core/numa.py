"""NUMA binding: which CPUs each local rank may run on. Pure: no sysfs, no syscalls.

The modes are torch 2.13's ``--numa-binding`` (``torch/numa/binding.py``), applied to a
parsed ``CpuTopology`` instead of reading sysfs inline:

- ``node``: every CPU of the rank's NUMA node.
- ``socket``: every CPU of every NUMA node on the socket of the rank's node.
- ``exclusive``: the node's physical cores are split evenly among the ranks on that node
  (SMT siblings stay together; the lowest ranks get one extra core when it does not divide).
- ``core-complex``: one last-level-cache group (an AMD CCX, an Intel L3 slice domain) of the
  rank's node; groups with more CPUs first, ranks on the node take them in turn.

As in torch, only CPUs the supervisor itself may use (its affinity mask, ``allowed``) are
handed out. Torch picks a rank's node from its GPU (local rank N uses GPU N). Without
devices, ranks are spread over the NUMA nodes that have usable CPUs in balanced contiguous
blocks (``rank_nodes``), the way GPUs are numbered on real machines: with 8 ranks and 2
nodes, ranks 0-3 use node 0 and ranks 4-7 node 1; with 2 ranks and 4 nodes, nodes 0 and 2
(one per socket on a 2x2 machine). Callers that know each rank's device node pass
``device_nodes``. Memory-only nodes (no usable CPU) never get ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Literal, get_args

import msgspec

Mode = Literal["node", "socket", "exclusive", "core-complex"]
# local_rank -> CPUs to bind the worker to, or None (what the worker group is given)
CpusFor = Callable[[int], tuple[int, ...] | None]
MODES: tuple[str, ...] = get_args(Mode)


class NumaBindingError(Exception):
    """The requested binding cannot be made on this topology (one line, for the user)."""


class CpuTopology(msgspec.Struct, frozen=True):
    """What sysfs says about the machine, already parsed.

    Missing entries mean "unknown": a CPU without a socket is on socket 0, without thread
    siblings it is a core of its own, without cache siblings its node is one core complex.
    """

    node_cpus: Mapping[int, frozenset[int]]  # NUMA node -> its logical CPUs
    socket_of: Mapping[int, int] = msgspec.field(default_factory=dict)  # CPU -> physical package
    thread_siblings: Mapping[int, frozenset[int]] = msgspec.field(default_factory=dict)  # same core
    cache_siblings: Mapping[int, frozenset[int]] = msgspec.field(default_factory=dict)  # same LLC

    def socket(self, cpu: int) -> int:
        return self.socket_of.get(cpu, 0)

    def core_key(self, cpu: int) -> int:
        """The lowest sibling stands for the physical core (as torch does)."""
        return min(self.thread_siblings.get(cpu, frozenset({cpu})) | {cpu})

    def cache_key(self, cpu: int) -> int | None:
        siblings = self.cache_siblings.get(cpu)
        return min(siblings | {cpu}) if siblings else None


# --------------------------------------------------------------------------- cpu lists


def parse_cpu_list(text: str) -> frozenset[int]:
    """Parse a sysfs CPU list such as ``0-3,8,10-11`` (empty text is the empty set)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        first, _, last = part.partition("-")
        try:
            lo, hi = int(first), int(last or first)
        except ValueError:
            raise ValueError(f"not a CPU list: {text.strip()!r}") from None
        if lo < 0 or hi < lo:
            raise ValueError(f"not a CPU list: {text.strip()!r}")
        cpus.update(range(lo, hi + 1))
    return frozenset(cpus)


def format_cpu_list(cpus: Iterable[int]) -> str:
    """The inverse of ``parse_cpu_list``: ``{0, 1, 2, 5}`` -> ``0-2,5``."""
    ordered = sorted(set(cpus))
    ranges: list[str] = []
    start = prev = ordered[0] if ordered else 0
    for cpu in ordered[1:]:
        if cpu != prev + 1:
            ranges.append(_span(start, prev))
            start = cpu
        prev = cpu
    if ordered:
        ranges.append(_span(start, prev))
    return ",".join(ranges)


def _span(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"{lo}-{hi}"


# --------------------------------------------------------------------------- placement


def rank_nodes(nodes: Sequence[int], nproc: int) -> list[int]:
    """Spread ``nproc`` ranks over ``nodes`` in balanced contiguous blocks."""
    if not nodes:
        raise NumaBindingError("no NUMA node has a CPU this process may use")
    return [nodes[rank * len(nodes) // nproc] for rank in range(nproc)]


def usable_nodes(
    topology: CpuTopology, allowed: AbstractSet[int] | None = None
) -> dict[int, frozenset[int]]:
    """Each node's CPUs that we may use; nodes left without any are dropped."""
    usable: dict[int, frozenset[int]] = {}
    for node in sorted(topology.node_cpus):
        cpus = topology.node_cpus[node]
        if allowed is not None:
            cpus = cpus & frozenset(allowed)
        if cpus:
            usable[node] = cpus
    return usable


def bind_ranks(
    topology: CpuTopology,
    mode: str,
    nproc: int,
    *,
    allowed: AbstractSet[int] | None = None,
    device_nodes: Sequence[int] | None = None,
) -> list[tuple[int, ...]]:
    """The sorted CPU set of every local rank ``0..nproc-1`` for a binding ``mode``."""
    if mode not in MODES:
        raise NumaBindingError(f"unknown NUMA binding {mode!r}; expected one of {MODES}")
    if nproc < 1:
        return []
    usable = usable_nodes(topology, allowed)
    nodes = _nodes_for_ranks(usable, nproc, device_nodes)
    pick = _PICKERS[mode]
    return [tuple(sorted(pick(topology, usable, nodes, rank))) for rank in range(nproc)]


def _nodes_for_ranks(
    usable: Mapping[int, frozenset[int]], nproc: int, device_nodes: Sequence[int] | None
) -> list[int]:
    if device_nodes is None:
        return rank_nodes(list(usable), nproc)
    if len(device_nodes) < nproc:
        raise NumaBindingError(f"{nproc} ranks but only {len(device_nodes)} device nodes")
    for node in device_nodes[:nproc]:
        if node not in usable:
            raise NumaBindingError(f"NUMA node {node} has no CPU this process may use")
    return list(device_nodes[:nproc])


def _peers(nodes: Sequence[int], rank: int) -> tuple[int, int]:
    """(this rank's position among the ranks on its node, how many ranks share it)."""
    sharing = [r for r, node in enumerate(nodes) if node == nodes[rank]]
    return sharing.index(rank), len(sharing)


Picker = Callable[[CpuTopology, Mapping[int, frozenset[int]], Sequence[int], int], frozenset[int]]


def _pick_node(
    topology: CpuTopology, usable: Mapping[int, frozenset[int]], nodes: Sequence[int], rank: int
) -> frozenset[int]:
    return usable[nodes[rank]]


def _pick_socket(
    topology: CpuTopology, usable: Mapping[int, frozenset[int]], nodes: Sequence[int], rank: int
) -> frozenset[int]:
    # a node's socket is the socket of its lowest usable CPU (torch: "an arbitrary CPU")
    socket = topology.socket(min(usable[nodes[rank]]))
    same = [cpus for cpus in usable.values() if topology.socket(min(cpus)) == socket]
    return frozenset().union(*same)


def _pick_exclusive(
    topology: CpuTopology, usable: Mapping[int, frozenset[int]], nodes: Sequence[int], rank: int
) -> frozenset[int]:
    node = nodes[rank]
    index, sharing = _peers(nodes, rank)
    cores = _group(usable[node], topology.core_key)
    ordered = [cores[key] for key in sorted(cores)]
    per, extra = divmod(len(ordered), sharing)
    if per < 1:
        raise NumaBindingError(
            f"exclusive binding: NUMA node {node} has {len(ordered)} usable physical cores "
            f"for {sharing} ranks"
        )
    start = index * per + min(index, extra)
    end = start + per + (1 if index < extra else 0)
    return frozenset().union(*ordered[start:end])


def _pick_core_complex(
    topology: CpuTopology, usable: Mapping[int, frozenset[int]], nodes: Sequence[int], rank: int
) -> frozenset[int]:
    node = nodes[rank]
    index, _ = _peers(nodes, rank)
    cpus = usable[node]
    whole_node = min(cpus)  # CPUs with no known cache group form one complex per node

    def complex_of(cpu: int) -> int:
        key = topology.cache_key(cpu)
        return whole_node if key is None else key

    groups = _group(cpus, complex_of)
    # bigger complexes first, then the lowest CPU (torch's order)
    ordered = sorted(groups.items(), key=lambda item: (-len(item[1]), item[0]))
    return ordered[index % len(ordered)][1]


def _group(cpus: Iterable[int], key: Callable[[int], int]) -> dict[int, frozenset[int]]:
    groups: dict[int, set[int]] = {}
    for cpu in cpus:
        groups.setdefault(key(cpu), set()).add(cpu)
    return {k: frozenset(v) for k, v in groups.items()}


_PICKERS: dict[str, Picker] = {
    "node": _pick_node,
    "socket": _pick_socket,
    "exclusive": _pick_exclusive,
    "core-complex": _pick_core_complex,
}
