"""The per-rank environment and command line: exactly torchrun's contract.

Pure: the caller passes the supervisor's own environment in, so tests can compare the
result with a recorded expectation without touching ``os.environ``.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping, Sequence
from string import Template

import msgspec


class EnvContractError(Exception):
    """The requested layout cannot be expressed (e.g. more ranks than devices)."""


class GroupLayout(msgspec.Struct, frozen=True):
    """Where this node's workers sit in the job for one attempt."""

    run_id: str
    role: str
    local_world_size: int
    group_rank: int
    group_world_size: int
    rank_offset: int
    world_size: int
    master_addr: str
    master_port: int
    restart_count: int
    max_restarts: int
    virtual_local_rank: bool = False


# Variables whose value changes from one attempt to the next (the rank's place in this
# round, the store of this attempt, the attempt's own files); everything else a worker gets
# is the same for every attempt of its local rank, so a standby can start with it.
PER_ATTEMPT_ENV = (
    "RANK",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_ERROR_FILE",
)


# Variables that may differ between the local ranks of one node, and so between the
# standbys one fork server forks (applied in each forked child): ``LOCAL_RANK`` and, with
# a virtual local rank, a split ``CUDA_VISIBLE_DEVICES``. A rank whose environment differs
# from the node's in anything else gets a standby of its own instead.
PER_RANK_ENV = ("LOCAL_RANK", "CUDA_VISIBLE_DEVICES")


def fork_server_env(standby_envs: Sequence[Mapping[str, str]]) -> dict[str, str]:
    """The environment a node's fork server starts with: the first rank's standby
    environment (per-attempt variables already out) less the per-rank variables.

    The fork server runs ``sitecustomize``, ``.pth`` files and ``LD_PRELOAD`` constructors
    once per node with it; a rank that differs in anything else is not forked from it
    (``fork_mismatch``)."""
    first = standby_envs[0] if standby_envs else {}
    return {k: v for k, v in first.items() if k not in PER_RANK_ENV}


def fork_mismatch(server_env: Mapping[str, str], standby_env: Mapping[str, str]) -> str | None:
    """The first variable, other than the per-rank and per-attempt ones, in which a rank's
    standby environment differs from the fork server's; None if it can be forked."""
    skip = set(PER_RANK_ENV) | set(PER_ATTEMPT_ENV)
    for name in sorted(server_env.keys() | standby_env.keys()):
        if name not in skip and server_env.get(name) != standby_env.get(name):
            return name
    return None


def worker_env(
    base: Mapping[str, str],
    layout: GroupLayout,
    local_rank: int,
    *,
    error_file: str,
    timer_file: str | None,
) -> dict[str, str]:
    """The environment of one worker: the supervisor's own plus torchrun's variables."""
    env = dict(base)
    rank = layout.rank_offset + local_rank
    env.update(
        {
            "RANK": str(rank),
            "GROUP_RANK": str(layout.group_rank),
            "ROLE_RANK": str(rank),  # one role per job: role rank == global rank
            "ROLE_NAME": layout.role,
            "LOCAL_WORLD_SIZE": str(layout.local_world_size),
            "WORLD_SIZE": str(layout.world_size),
            "GROUP_WORLD_SIZE": str(layout.group_world_size),
            "ROLE_WORLD_SIZE": str(layout.world_size),
            "MASTER_ADDR": layout.master_addr,
            "MASTER_PORT": str(layout.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(layout.restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(layout.max_restarts),
            "TORCHELASTIC_RUN_ID": layout.run_id,
            # we host no store: the rank-0 worker does, fresh for every attempt
            "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            "TORCHELASTIC_ERROR_FILE": error_file,
        }
    )
    if timer_file is not None:
        env["TORCHELASTIC_TIMER_FILE"] = timer_file
    else:
        env.pop("TORCHELASTIC_TIMER_FILE", None)
    _set_local_rank(env, base, local_rank, layout.virtual_local_rank)
    return env


def _set_local_rank(
    env: dict[str, str], base: Mapping[str, str], local_rank: int, virtual: bool
) -> None:
    if not virtual:
        env["LOCAL_RANK"] = str(local_rank)
        return
    # virtual local rank: every worker sees one device as device 0
    env["LOCAL_RANK"] = "0"
    visible = base.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        env["CUDA_VISIBLE_DEVICES"] = str(local_rank)
        return
    devices = [d.strip() for d in visible.split(",") if d.strip()]
    if local_rank >= len(devices):
        raise EnvContractError(
            f"local rank {local_rank} has no device: CUDA_VISIBLE_DEVICES={visible} "
            f"lists {len(devices)}"
        )
    env["CUDA_VISIBLE_DEVICES"] = devices[local_rank]


def default_omp_threads(base: Mapping[str, str], local_world_size: int) -> dict[str, str]:
    """torchrun sets OMP_NUM_THREADS=1 for several workers when the user did not."""
    if "OMP_NUM_THREADS" in base or local_world_size <= 1:
        return dict(base)
    return {**base, "OMP_NUM_THREADS": "1"}


def interpreter(python: str) -> list[str]:
    """How a worker's Python is invoked, before the script: unbuffered, as torchrun does."""
    return [python, "-u"]


# what a Python interpreter's file is called: python, python3, python3.11 (a venv's too)
PYTHON_NAME = re.compile(r"python[0-9.]*")


def standby_python(default: str, *, no_python: bool, script: str,
                   args: Sequence[str]) -> str | None:
    """The interpreter the fork server and the standbys run for the job's command.

    ``default`` ($PYTHON_EXEC, or the supervisor's own) for a script run with Python; with
    ``--no-python``, the command itself when it names a Python interpreter run unbuffered
    (``VENV/bin/python -u SCRIPT``, ``-m MODULE`` or ``-c CODE``: the form of the shipped
    configs), so a job's own venv gets the same forked starts. None: no standby can run
    the command as its cold start would (another executable, or another form)."""
    if not no_python:
        return default
    if PYTHON_NAME.fullmatch(posixpath.basename(script)) and list(args[:1]) == ["-u"]:
        return script
    return None


def worker_argv(
    python: str,
    script: str,
    args: Sequence[str],
    local_rank: int,
    *,
    module: bool = False,
    no_python: bool = False,
    run_path: bool = False,
) -> list[str]:
    """The command line of one worker, with ``${local_rank}`` substituted like torchrun."""
    if no_python:
        head = [script]
    elif run_path:
        head = [*interpreter(python), "-c", _RUN_PATH, script]
    elif module:
        head = [*interpreter(python), "-m", script]
    else:
        head = [*interpreter(python), script]
    tail = [Template(a).safe_substitute(local_rank=str(local_rank)) for a in args]
    return [*head, *tail]


# run a script with runpy in a fresh interpreter, as torchrun's --run-path does in-process
_RUN_PATH = (
    "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)
