"""Whose deadline request is whose: found once per process by its ancestry, remembered
while it lives (``OwnerCache``), over real process chains."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from supervisor.watchdog.owners import MAX_DEPTH, OwnerCache
from supervisor.workers.proctree import parent_of
from tests.support.paths import WORKERS
from tests.support.processes import wait_dead


@contextmanager
def chain(depth: int) -> Iterator[tuple[int, int]]:
    """A chain of ``depth`` forks under a top process: yields (top pid, leaf pid)."""
    with subprocess.Popen(
        [sys.executable, str(WORKERS / "deadline_flood.py"), "-", str(depth)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
    ) as top:
        try:
            assert top.stdout is not None
            said = top.stdout.readline().split()  # the chain forks at once, then says so
            assert said[:1] == [b"leaf"], said
            yield top.pid, int(said[1])
        finally:
            os.killpg(top.pid, signal.SIGKILL)
            top.wait(timeout=10)


def test_a_descendant_as_deep_as_the_limit_is_owned_and_one_deeper_is_not() -> None:
    with chain(MAX_DEPTH) as (top, leaf), chain(MAX_DEPTH + 1) as (far_top, far_leaf):
        owners = OwnerCache(lambda: {top: 3, far_top: 4})
        try:
            assert owners(leaf) == 3
            assert owners(far_leaf) is None
            assert owners(top) == 3
        finally:
            owners.close()


async def test_the_answer_is_remembered_while_the_process_lives() -> None:
    with chain(2) as (top, leaf):
        owners = OwnerCache(lambda: {top: 0})
        try:
            assert owners(leaf) == 0
            assert owners.size == 1
            parent = parent_of(leaf)
            assert parent is not None and parent != top
            os.kill(parent, signal.SIGKILL)  # the leaf is reparented out of the tree ...
            await wait_dead([parent], 10)
            assert parent_of(leaf) != parent
            assert owners(leaf) == 0  # ... and still its worker's: no second walk
        finally:
            owners.close()


async def test_a_process_that_exits_is_forgotten() -> None:
    with chain(1) as (top, leaf):
        owners = OwnerCache(lambda: {top: 0})
        try:
            assert owners(leaf) == 0
            os.kill(leaf, signal.SIGKILL)
            await wait_dead([leaf], 10)
            assert owners(leaf) is None  # its pid may name someone else's process now
            assert owners.size == 0
        finally:
            owners.close()


def test_a_new_set_of_workers_forgets_every_answer() -> None:
    with chain(1) as (top, leaf):
        workers = {top: 0}
        owners = OwnerCache(lambda: workers)
        try:
            assert owners(leaf) == 0
            workers = {}  # the group stopped
            assert owners(leaf) is None
            workers = {top: 5}  # a new attempt (a standby that became rank 5)
            assert owners(leaf) == 5
        finally:
            owners.close()


def test_a_process_outside_every_worker_is_remembered_as_not_owned() -> None:
    with chain(1) as (top, _leaf):
        owners = OwnerCache(lambda: {top: 0})
        try:
            assert owners(os.getpid()) is None  # the supervisor itself: never owned
            assert owners(1) is None
            assert owners.size == 2  # both pinned: no second walk while they live
        finally:
            owners.close()


def test_the_cache_is_bounded() -> None:
    with chain(1) as (top, leaf):
        owners = OwnerCache(lambda: {top: 0}, max_entries=1)
        try:
            assert owners(leaf) == 0
            assert owners(top) == 0
            assert owners.size == 1
        finally:
            owners.close()
