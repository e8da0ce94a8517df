"""A node's sending side in a process of its own, to be killed in the middle of a transfer.

argv: PORT SECRET_HEX BASE_DIR. Saves step 1 (1 MiB per rank) and sends it to the buddy
on 127.0.0.1:PORT at full speed, prints ``sent 1``; then saves step 2 (16 MiB per rank)
and sends it paced at 1 MiB/s, printing ``sending 2`` first: the test SIGKILLs it while
those bytes flow."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import anyio

from supervisor.core.slots import SlotTable
from supervisor.snapshots.memory import Regions
from supervisor.snapshots.replicate.auth import Auth
from supervisor.snapshots.replicate.send import BuddySender
from tests.support.snapshotbytes import save_step

RANKS = frozenset({2, 3})
WORLD = 4


async def main() -> None:
    port, secret, base = int(sys.argv[1]), bytes.fromhex(sys.argv[2]), Path(sys.argv[3])
    regions = Regions.create(base)
    table = SlotTable()
    table.decide(WORLD)
    sender = BuddySender(table, regions.open_read, Auth(secret=secret), "node-a")
    sender.aim(("127.0.0.1", port), RANKS, WORLD)
    for rank in sorted(RANKS):
        save_step(table, regions, rank, 1)
    assert await sender.send_newest() == 1
    os.write(1, b"sent 1\n")
    for rank in sorted(RANKS):
        save_step(table, regions, rank, 2, 16 << 20)
    sender.rate = float(1 << 20)
    os.write(1, b"sending 2\n")
    await sender.send_newest()
    os.write(1, b"sent 2\n")


anyio.run(main)
