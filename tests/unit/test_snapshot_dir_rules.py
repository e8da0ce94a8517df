"""What a run trusts in ``--snapshot-dir``: manifests, markers, pruning (pure rules)."""

from __future__ import annotations

import json

import pytest

from supervisor.core.snapshotdir import (
    Manifest,
    Marker,
    Part,
    file_name,
    merge,
    parse_manifest,
    parse_marker,
    parse_part,
    step_of,
    to_prune,
)


def test_a_manifest_round_trips() -> None:
    assert parse_manifest(Manifest("job", 4).encode()) == Manifest("job", 4)


@pytest.mark.parametrize("data", [b"{", b"[]", b'{"format": 2, "run_id": "a", "world_size": 1}',
                                  b'{"format": 1, "run_id": 3, "world_size": 1}',
                                  b'{"format": 1, "run_id": "a", "world_size": 0}',
                                  b'{"format": 1, "run_id": "a", "world_size": true}'])
def test_a_malformed_manifest_is_refused(data: bytes) -> None:
    assert isinstance(parse_manifest(data), str)


def test_a_marker_round_trips() -> None:
    marker = Marker(7, 2, False, {0: file_name(0, 0), 1: file_name(1, 1)})
    assert parse_marker(marker.encode(), 7) == marker
    replicated = Marker(7, 3, True, {-1: file_name(0, -1)})
    assert parse_marker(replicated.encode(), 7) == replicated


def marker(files: dict[str, str], step: int = 7, world_size: int = 2) -> bytes:
    return json.dumps({"format": 1, "step": step, "world_size": world_size,
                       "replicated": False, "files": files}).encode()


@pytest.mark.parametrize("path", ["../x.pt", "/etc/passwd", "node0/../../x.pt",
                                  "node0/rank1.pt/../../../x", "node0/secret.txt"])
def test_a_marker_naming_a_path_outside_its_step_is_refused(path: str) -> None:
    found = parse_marker(marker({"0": "node0/rank0.pt", "1": path}), 7)
    assert isinstance(found, str) and "outside" in found


def test_a_marker_of_another_step_or_missing_ranks_is_refused() -> None:
    files = {"0": "node0/rank0.pt", "1": "node0/rank1.pt"}
    assert isinstance(parse_marker(marker(files), 8), str)
    assert isinstance(parse_marker(marker({"0": "node0/rank0.pt"}), 7), str)


def test_step_directories_are_recognised() -> None:
    assert step_of("step_12") == 12
    assert step_of("step_x") is None and step_of(".step_1.part") is None


def test_only_steps_older_than_the_two_newest_complete_are_pruned() -> None:
    assert to_prune([3, 5], [1, 2, 3, 4, 5, 6]) == [1, 2]
    assert to_prune([5], [1, 5]) == []  # one complete step: keep everything


def part(group_rank: int, files: dict[int, str], *, nodes: int = 2, world_size: int = 2,
         replicated: bool = False, step: int = 7) -> Part:
    return Part(step, group_rank, nodes, world_size, replicated, files)


def test_a_step_is_whole_only_when_every_nodes_part_is_there() -> None:
    a = part(0, {0: file_name(0, 0)})
    b = part(1, {1: file_name(1, 1)})
    assert merge([a]) is None and merge([b]) is None
    assert merge([b, a]) == Marker(7, 2, False, {0: file_name(0, 0), 1: file_name(1, 1)})


def test_parts_that_disagree_or_miss_a_rank_make_no_marker() -> None:
    a = part(0, {0: file_name(0, 0)})
    assert merge([a, part(1, {1: file_name(1, 1)}, world_size=3)]) is None
    assert merge([a, part(1, {1: file_name(1, 1)}, nodes=3)]) is None
    assert merge([a, part(1, {2: file_name(1, 2)})]) is None


def test_a_replicated_step_has_one_part() -> None:
    only = part(0, {-1: file_name(0, -1)}, nodes=1, world_size=4, replicated=True)
    assert merge([only]) == Marker(7, 4, True, {-1: file_name(0, -1)})


def test_a_part_round_trips_and_names_only_files_of_its_own_node() -> None:
    a = part(1, {1: file_name(1, 1)})
    assert parse_part(a.encode(), 7, 1) == a
    assert parse_part(a.encode(), 7, 0) is None  # read as another node's
    assert parse_part(a.encode(), 8, 1) is None
    stray = part(1, {1: file_name(0, 1)})  # a file in node0's directory
    assert parse_part(stray.encode(), 7, 1) is None
    assert parse_part(b'{"format": 1', 7, 1) is None
