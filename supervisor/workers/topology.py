"""Reading the CPU topology from sysfs, and the ``--numa-binding`` seam for the supervisor.

``read_topology(root)`` reads the files torch's NUMA binding reads, under a configurable
root so tests can point it at a synthetic tree:

- ``sys/devices/system/node/node*/cpulist``: the CPUs of each NUMA node;
- ``sys/devices/system/cpu/cpu*/topology/physical_package_id``: the socket;
- ``.../topology/thread_siblings_list`` (else ``core_id`` within the package): the core;
- ``.../cache/index*/{level,type,shared_cpu_list}``: the CPUs sharing the highest-level
  data or unified cache (L3 on current x86), i.e. the core complex.

Whatever is missing falls back with one warning per kind of gap: no NUMA directory means
one node holding every online CPU, no package id means socket 0, no siblings mean every
CPU is a core of its own, no cache information means one core complex per node.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from supervisor.config import ConfigError, Settings
from supervisor.core.numa import (
    CpusFor,
    CpuTopology,
    NumaBindingError,
    bind_ranks,
    format_cpu_list,
    parse_cpu_list,
)

logger = logging.getLogger(__name__)

_NUMBERED = re.compile(r"^(node|cpu|index)(\d+)$")


def read_topology(root: str | Path = "/") -> CpuTopology:
    """Parse the machine's topology from sysfs under ``root``; never raises for gaps."""
    system = Path(root) / "sys" / "devices" / "system"
    gaps: set[str] = set()
    nodes = _read_nodes(system, gaps)
    cpus = sorted(frozenset().union(*nodes.values()))
    topology = CpuTopology(
        node_cpus=nodes,
        socket_of=_read_sockets(system, cpus, gaps),
        thread_siblings=_read_thread_siblings(system, cpus, gaps),
        cache_siblings=_read_cache_siblings(system, cpus, gaps),
    )
    for gap in sorted(gaps):
        logger.warning("CPU topology: %s", gap)
    return topology


def _numbered(directory: Path, prefix: str) -> list[tuple[int, Path]]:
    """``prefix<N>`` entries of a directory, sorted by N (empty if it does not exist)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = []
    for name in names:
        m = _NUMBERED.match(name)
        if m and m.group(1) == prefix:
            found.append((int(m.group(2)), directory / name))
    return sorted(found)


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _read_list(path: Path) -> frozenset[int] | None:
    text = _read_text(path)
    if text is None:
        return None
    try:
        return parse_cpu_list(text)
    except ValueError:
        return None


def _read_nodes(system: Path, gaps: set[str]) -> dict[int, frozenset[int]]:
    nodes: dict[int, frozenset[int]] = {}
    for index, path in _numbered(system / "node", "node"):
        cpus = _read_list(path / "cpulist")
        if cpus is not None:
            nodes[index] = cpus
    if nodes:
        return nodes
    gaps.add("no NUMA nodes in sysfs; treating every online CPU as node 0")
    online = _read_list(system / "cpu" / "online")
    if online is None:
        online = frozenset(i for i, _ in _numbered(system / "cpu", "cpu"))
    if not online:
        online = frozenset(range(os.cpu_count() or 1))
    return {0: online}


def _read_sockets(system: Path, cpus: list[int], gaps: set[str]) -> dict[int, int]:
    sockets: dict[int, int] = {}
    for cpu in cpus:
        text = _read_text(system / "cpu" / f"cpu{cpu}" / "topology" / "physical_package_id")
        try:
            sockets[cpu] = max(int(text or ""), 0)  # -1 means "unknown": one socket
        except ValueError:
            gaps.add("no physical_package_id for some CPUs; assuming socket 0")
    return sockets


def _read_thread_siblings(
    system: Path, cpus: list[int], gaps: set[str]
) -> dict[int, frozenset[int]]:
    siblings: dict[int, frozenset[int]] = {}
    by_core: dict[tuple[str, int], set[int]] = {}
    for cpu in cpus:
        topo = system / "cpu" / f"cpu{cpu}" / "topology"
        listed = _read_list(topo / "thread_siblings_list")
        if listed:
            siblings[cpu] = listed
            continue
        core_id = _read_text(topo / "core_id")
        package = _read_text(topo / "physical_package_id")
        if core_id is not None and core_id.strip().isdigit():
            key = ((package or "").strip(), int(core_id))
            by_core.setdefault(key, set()).add(cpu)
        else:
            gaps.add("no thread siblings or core_id for some CPUs; each is its own core")
    for members in by_core.values():
        for cpu in members:
            siblings[cpu] = frozenset(members)
    return siblings


def _read_cache_siblings(
    system: Path, cpus: list[int], gaps: set[str]
) -> dict[int, frozenset[int]]:
    shared: dict[int, frozenset[int]] = {}
    for cpu in cpus:
        found = _last_level_cache(system / "cpu" / f"cpu{cpu}" / "cache")
        if found is None:
            gaps.add("no cache information for some CPUs; one core complex per NUMA node")
        else:
            shared[cpu] = found
    return shared


def _last_level_cache(cache_dir: Path) -> frozenset[int] | None:
    """CPUs sharing the highest-level data or unified cache (instruction caches ignored)."""
    best_level = -1
    best: frozenset[int] | None = None
    for _, index in _numbered(cache_dir, "index"):
        kind = (_read_text(index / "type") or "").strip()
        level_text = (_read_text(index / "level") or "").strip()
        if kind not in ("Unified", "Data") or not level_text.isdigit():
            continue
        members = _read_list(index / "shared_cpu_list")
        if members and int(level_text) > best_level:
            best_level, best = int(level_text), members
    return best


# --------------------------------------------------------------------------- the seam


def cpus_for(
    settings: Settings,
    *,
    root: str | Path = "/",
    allowed: frozenset[int] | None = None,
) -> CpusFor | None:
    """The ``cpus`` argument of ``supervise`` for ``settings.numa_binding`` (None: no binding).

    The binding of every local rank is computed once, up front, so an impossible request
    (``exclusive`` with fewer cores than ranks) is a config error before anything starts.
    ``allowed`` defaults to this process's own affinity, as in torch.
    """
    mode = settings.numa_binding
    if mode is None:
        return None
    if allowed is None:
        allowed = frozenset(os.sched_getaffinity(0))
    topology = read_topology(root)
    try:
        bindings = bind_ranks(topology, mode, settings.local_world_size, allowed=allowed)
    except NumaBindingError as exc:
        raise ConfigError(f"numa_binding: {exc}") from None
    for local_rank, cpus in enumerate(bindings):
        logger.info("numa binding %s: local rank %d -> CPUs %s", mode, local_rank,
                    format_cpu_list(cpus))
    return _lookup(bindings)


def _lookup(bindings: list[tuple[int, ...]]) -> CpusFor:
    def cpus(local_rank: int) -> tuple[int, ...] | None:
        return bindings[local_rank] if 0 <= local_rank < len(bindings) else None

    return cpus
