"""Two nodes' buddy copies, each with its own slot table, regions, server and sender, over
real TCP: a round makes each keep the other's newest step; a round of one sends nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio

from supervisor.core.slots import SlotTable
from supervisor.snapshots.memory import Regions
from supervisor.snapshots.replicate.auth import Auth
from supervisor.snapshots.replicate.copies import BuddyCopies
from tests.support.snapshotbytes import save_step
from tests.support.waiting import until

AUTH = Auth(secret=b"the job's secret, 32 bytes long!")
WORLD = 4
RANKS = {"a": frozenset({0, 1}), "b": frozenset({2, 3})}


@asynccontextmanager
async def nodes(tmp_path: Path) -> AsyncIterator[dict[str, tuple[BuddyCopies, int]]]:
    """Nodes a and b running their buddy copies; name -> (copies, port)."""
    started: dict[str, tuple[BuddyCopies, int]] = {}
    regions = []
    async with anyio.create_task_group() as tg:
        for name in RANKS:
            (tmp_path / name).mkdir()
            region = Regions.create(tmp_path / name)
            regions.append(region)
            table = SlotTable()
            table.decide(WORLD)
            copies = BuddyCopies(name, table, region, AUTH, host="127.0.0.1")
            started[name] = (copies, await tg.start(copies.run))
        try:
            yield started
        finally:
            tg.cancel_scope.cancel()
            for region in regions:
                region.close()


def save(copies: BuddyCopies, name: str, step: int) -> None:
    for rank in sorted(RANKS[name]):
        save_step(copies.sender.table, copies.receiver.regions, rank, step)
    copies.wake()


async def test_a_round_of_two_makes_each_keep_the_others_step(tmp_path: Path) -> None:
    async with nodes(tmp_path) as started:
        addresses = {name: ("127.0.0.1", port) for name, (_, port) in started.items()}
        for name, (copies, _) in started.items():
            save(copies, name, 5)
            copies.on_round(["a", "b"], addresses, RANKS[name], WORLD, restored=None)
        a, b = started["a"][0], started["b"][0]
        await until(lambda: "b" in a.receiver.held and "a" in b.receiver.held)
        assert (a.receiver.held["b"].step, b.receiver.held["a"].step) == (5, 5)
        assert sorted(a.receiver.held["b"].ranks) == [2, 3]
        assert a.status()["buddy"] == "b" and a.status()["ward"] == "b"
        save(a, "a", 6)  # a newer step replaces the copy b keeps
        await until(lambda: b.receiver.held["a"].step == 6)


async def test_a_round_of_one_sends_nothing_and_keeps_nothing(tmp_path: Path) -> None:
    async with nodes(tmp_path) as started:
        a, port_a = started["a"]
        b, _ = started["b"]
        save(a, "a", 5)
        a.on_round(["a"], {"a": ("127.0.0.1", port_a)}, RANKS["a"], WORLD, restored=None)
        assert await a.sender.send_newest() is None
        # b is not in a's round: a keeps nothing of b's, whatever b sends
        b.on_round(["b", "a"], {"a": ("127.0.0.1", port_a)}, RANKS["b"], WORLD,
                   restored=None)
        save(b, "b", 5)
        await until(lambda: b.counts.refused_by_buddy >= 1)
        assert a.receiver.held == {} and a.status()["buddy"] is None
