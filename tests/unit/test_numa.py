"""NUMA binding: pure CPU-set computation and the sysfs reader
(tests/e2e/test_numa_binding.py binds a real daemon's workers)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

import pytest

from supervisor.config import ConfigError, build
from supervisor.core.numa import (
    CpuTopology,
    NumaBindingError,
    bind_ranks,
    format_cpu_list,
    parse_cpu_list,
    rank_nodes,
)
from supervisor.workers.topology import cpus_for, read_topology

# ----------------------------------------------------------------------------- fixtures
#
# A 2-socket machine, 2 NUMA nodes per socket, 4 physical cores per node with 2 hardware
# threads each (Linux numbering: CPU c and c+16 are siblings), and two 2-core L3 complexes
# per node. Node n holds cores 4n..4n+3 and their siblings.

CORES = 16


def _node_cpus(node: int) -> frozenset[int]:
    cores = range(4 * node, 4 * node + 4)
    return frozenset([*cores, *(c + CORES for c in cores)])


def _core(cpu: int) -> frozenset[int]:
    first = cpu % CORES
    return frozenset({first, first + CORES})


def _complex(cpu: int) -> frozenset[int]:
    base = (cpu % CORES) // 2 * 2
    return _core(base) | _core(base + 1)


def machine(*, smt: bool = True, caches: bool = True) -> CpuTopology:
    nodes = {n: _node_cpus(n) for n in range(4)}
    cpus = sorted(frozenset().union(*nodes.values()))
    return CpuTopology(
        node_cpus=nodes,
        socket_of={c: (c % CORES) // 8 for c in cpus},
        thread_siblings={c: _core(c) for c in cpus} if smt else {},
        cache_siblings={c: _complex(c) for c in cpus} if caches else {},
    )


def cpus(*groups: Iterable[int]) -> tuple[int, ...]:
    return tuple(sorted(frozenset().union(*map(frozenset, groups))))


def cores(*first_threads: int) -> tuple[int, ...]:
    """The CPUs of the given physical cores (both hardware threads)."""
    return cpus(*(_core(c) for c in first_threads))


# ----------------------------------------------------------------------------- cpu lists


def test_cpu_list_round_trip() -> None:
    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpu_list("") == frozenset()
    assert format_cpu_list({11, 0, 1, 2, 3, 8, 10}) == "0-3,8,10-11"
    assert format_cpu_list([]) == ""


def test_cpu_list_rejects_garbage() -> None:
    with pytest.raises(ValueError):
        parse_cpu_list("0-x")
    with pytest.raises(ValueError):
        parse_cpu_list("5-2")


# ----------------------------------------------------------------------------- placement


def test_ranks_fill_nodes_in_contiguous_blocks() -> None:
    assert rank_nodes([0, 1, 2, 3], 8) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert rank_nodes([0, 1, 2, 3], 2) == [0, 2]  # one per socket
    assert rank_nodes([0, 1], 3) == [0, 0, 1]


def test_node_mode_binds_each_rank_to_its_node() -> None:
    bound = bind_ranks(machine(), "node", 4)
    assert bound == [tuple(sorted(_node_cpus(n))) for n in range(4)]


def test_node_mode_shares_a_node_between_neighbouring_ranks() -> None:
    bound = bind_ranks(machine(), "node", 8)
    assert bound[0] == bound[1] == tuple(sorted(_node_cpus(0)))
    assert bound[6] == bound[7] == tuple(sorted(_node_cpus(3)))


def test_socket_mode_binds_to_every_node_of_the_socket() -> None:
    bound = bind_ranks(machine(), "socket", 2)
    assert bound[0] == cpus(_node_cpus(0), _node_cpus(1))
    assert bound[1] == cpus(_node_cpus(2), _node_cpus(3))


def test_exclusive_mode_splits_physical_cores_keeping_siblings_together() -> None:
    bound = bind_ranks(machine(), "exclusive", 8)
    assert bound[0] == cores(0, 1)
    assert bound[1] == cores(2, 3)
    assert bound[2] == cores(4, 5)
    assert len(set(bound)) == 8


def test_exclusive_mode_gives_the_lowest_ranks_the_extra_cores() -> None:
    bound = bind_ranks(machine(), "exclusive", 12)  # 3 ranks per node of 4 cores
    assert bound[:3] == [cores(0, 1), cores(2), cores(3)]


def test_exclusive_mode_refuses_more_ranks_than_cores() -> None:
    with pytest.raises(NumaBindingError, match="4 usable physical cores for 5 ranks"):
        bind_ranks(machine(), "exclusive", 20)


def test_exclusive_without_smt_information_splits_logical_cpus() -> None:
    bound = bind_ranks(machine(smt=False), "exclusive", 4)
    assert bound[0] == (0, 1, 2, 3, 16, 17, 18, 19)  # every node CPU counts as a core
    two_per_node = bind_ranks(machine(smt=False), "exclusive", 8)
    assert two_per_node[0] == (0, 1, 2, 3) and two_per_node[1] == (16, 17, 18, 19)


def test_core_complex_mode_gives_ranks_on_a_node_different_l3_groups() -> None:
    bound = bind_ranks(machine(), "core-complex", 8)
    assert bound[0] == cores(0, 1)
    assert bound[1] == cores(2, 3)
    assert bound[7] == cores(14, 15)


def test_core_complex_mode_wraps_when_ranks_outnumber_complexes() -> None:
    bound = bind_ranks(machine(), "core-complex", 12)
    assert bound[0] == bound[2] == cores(0, 1)
    assert bound[1] == cores(2, 3)


def test_core_complex_mode_prefers_the_complex_with_more_usable_cpus() -> None:
    allowed = frozenset(range(32)) - {0}
    bound = bind_ranks(machine(), "core-complex", 4, allowed=allowed)
    assert bound[0] == cores(2, 3)  # the complex of CPU 0 lost a CPU: it comes second


def test_core_complex_without_cache_information_uses_the_whole_node() -> None:
    bound = bind_ranks(machine(caches=False), "core-complex", 4)
    assert bound[0] == tuple(sorted(_node_cpus(0)))


def test_only_allowed_cpus_are_handed_out() -> None:
    allowed = frozenset(range(0, 32, 2))
    for mode in ("node", "socket", "exclusive", "core-complex"):
        for cpu_set in bind_ranks(machine(), mode, 4, allowed=allowed):
            assert cpu_set and set(cpu_set) <= allowed, mode


def test_nodes_without_usable_cpus_get_no_ranks() -> None:
    allowed = _node_cpus(2) | _node_cpus(3)  # e.g. a cpuset limited to socket 1
    topology = machine()
    memory_only = CpuTopology({**topology.node_cpus, 4: frozenset()}, topology.socket_of,
                              topology.thread_siblings, topology.cache_siblings)
    bound = bind_ranks(memory_only, "node", 2, allowed=allowed)
    assert bound == [tuple(sorted(_node_cpus(2))), tuple(sorted(_node_cpus(3)))]


def test_known_device_nodes_decide_the_node() -> None:
    bound = bind_ranks(machine(), "node", 2, device_nodes=[3, 1])
    assert bound == [tuple(sorted(_node_cpus(3))), tuple(sorted(_node_cpus(1)))]
    with pytest.raises(NumaBindingError):
        bind_ranks(machine(), "node", 2, device_nodes=[0])


def test_no_usable_cpu_at_all_is_an_error() -> None:
    with pytest.raises(NumaBindingError, match="no NUMA node"):
        bind_ranks(machine(), "node", 1, allowed=frozenset({99}))


def test_unknown_mode_is_an_error() -> None:
    with pytest.raises(NumaBindingError, match="unknown NUMA binding"):
        bind_ranks(machine(), "rack", 1)


# ----------------------------------------------------------------------------- sysfs reader


def write_sysfs(root: Path, topology: CpuTopology, *, with_nodes: bool = True) -> None:
    """Lay ``topology`` out as sysfs files under ``root``."""
    system = root / "sys" / "devices" / "system"
    every = sorted(frozenset().union(*topology.node_cpus.values()))
    if with_nodes:
        for node, members in topology.node_cpus.items():
            _write(system / "node" / f"node{node}" / "cpulist", format_cpu_list(members))
        _write(system / "node" / "possible", format_cpu_list(topology.node_cpus))
    _write(system / "cpu" / "online", format_cpu_list(every))
    for cpu in every:
        base = system / "cpu" / f"cpu{cpu}"
        _write(base / "topology" / "physical_package_id", str(topology.socket_of[cpu]))
        _write(base / "topology" / "core_id", str(cpu % CORES))
        _write(base / "topology" / "thread_siblings_list",
               format_cpu_list(topology.thread_siblings[cpu]))
        caches = [(1, "Data", {cpu}), (1, "Instruction", set(every)), (2, "Unified", {cpu}),
                  (3, "Unified", set(topology.cache_siblings[cpu]))]
        for index, (level, kind, shared) in enumerate(caches):
            cache = base / "cache" / f"index{index}"
            _write(cache / "level", str(level))
            _write(cache / "type", kind)
            _write(cache / "shared_cpu_list", format_cpu_list(shared))


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def test_reader_parses_a_synthetic_sysfs_tree(tmp_path: Path) -> None:
    expected = machine()
    write_sysfs(tmp_path, expected)
    assert read_topology(tmp_path) == expected


def test_reader_falls_back_to_one_node_when_numa_is_unknown(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_sysfs(tmp_path, machine(), with_nodes=False)
    with caplog.at_level(logging.WARNING, logger="supervisor.workers.topology"):
        topology = read_topology(tmp_path)
    assert topology.node_cpus == {0: frozenset(range(32))}
    assert "no NUMA nodes" in caplog.text


def test_reader_uses_core_id_when_thread_siblings_are_missing(tmp_path: Path) -> None:
    write_sysfs(tmp_path, machine())
    for path in tmp_path.glob("sys/devices/system/cpu/cpu*/topology/thread_siblings_list"):
        path.unlink()
    assert read_topology(tmp_path).thread_siblings == machine().thread_siblings


def test_reader_warns_once_per_missing_kind(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _write(tmp_path / "sys/devices/system/node/node0/cpulist", "0-3")
    with caplog.at_level(logging.WARNING, logger="supervisor.workers.topology"):
        topology = read_topology(tmp_path)
    assert topology == CpuTopology({0: frozenset(range(4))})
    assert caplog.text.count("no cache information") == 1
    assert bind_ranks(topology, "exclusive", 2) == [(0, 1), (2, 3)]


def test_cpus_for_is_none_without_binding() -> None:
    assert cpus_for(build({"training_script": "x.py"})) is None


def test_cpus_for_computes_every_rank_up_front(tmp_path: Path) -> None:
    write_sysfs(tmp_path, machine())
    settings = build({"training_script": "x.py", "numa_binding": "exclusive",
                      "nproc_per_node": "8"})
    cpus_of = cpus_for(settings, root=tmp_path, allowed=frozenset(range(32)))
    assert cpus_of is not None
    assert cpus_of(1) == cores(2, 3)
    assert cpus_of(8) is None


def test_impossible_binding_is_a_config_error(tmp_path: Path) -> None:
    write_sysfs(tmp_path, machine())
    settings = build({"training_script": "x.py", "numa_binding": "exclusive",
                      "nproc_per_node": "40"})
    with pytest.raises(ConfigError, match="numa_binding: exclusive binding"):
        cpus_for(settings, root=tmp_path, allowed=frozenset(range(32)))
