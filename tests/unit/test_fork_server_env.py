"""Which environment a node's fork server starts with, and which ranks it can serve."""

from __future__ import annotations

from supervisor.core.envs import PER_RANK_ENV, fork_mismatch, fork_server_env


def rank(local_rank: int, **extra: str) -> dict[str, str]:
    return {"PATH": "/bin", "OMP_NUM_THREADS": "1", "LOCAL_RANK": str(local_rank), **extra}


def test_the_server_gets_what_ranks_share_less_the_per_rank_names() -> None:
    env = fork_server_env([rank(0, CUDA_VISIBLE_DEVICES="0"), rank(1, CUDA_VISIBLE_DEVICES="1")])
    assert env == {"PATH": "/bin", "OMP_NUM_THREADS": "1"}
    assert not set(PER_RANK_ENV) & env.keys()


def test_ranks_that_differ_only_per_rank_or_per_attempt_can_be_forked() -> None:
    server = fork_server_env([rank(0)])
    assert fork_mismatch(server, rank(3, CUDA_VISIBLE_DEVICES="3", RANK="7")) is None


def test_a_rank_that_differs_in_another_name_is_not_forked() -> None:
    server = fork_server_env([rank(0)])
    # a library such as libgomp reads OMP_NUM_THREADS when it loads: once per node
    assert fork_mismatch(server, rank(1, OMP_NUM_THREADS="2")) == "OMP_NUM_THREADS"
    assert fork_mismatch(server, {k: v for k, v in rank(1).items() if k != "PATH"}) == "PATH"
    assert fork_mismatch(server, rank(1, EXTRA="x")) == "EXTRA"
