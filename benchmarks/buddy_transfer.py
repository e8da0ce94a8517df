"""Buddy copies' transfer layer alone: one node's ranks sent to a buddy over loopback.

A sender and a buddy's server in one process (two supervisors' parts, real TCP, real
regions in ``--shm``, default /dev/shm), each rank's snapshot ``--mib`` MiB of bytes laid
out as a save (no torch). Per case (plain TCP with the job's secret, mutual TLS, and a
paced run at ``--rate``), several transfers of a new step each: the transfer time
(median, range), the rate, and the CPU-seconds per GiB copied (both ends together: this
process's CPU time over the transfers). Markdown to stdout.

    python benchmarks/buddy_transfer.py                 # 2 ranks x 190 MiB, 3 transfers
    python benchmarks/buddy_transfer.py --mib 64 --reps 5 --rate 200M
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import anyio

from supervisor.config import _bytes
from supervisor.core.slots import SlotTable
from supervisor.snapshots.memory import Regions
from supervisor.snapshots.replicate.auth import Auth, PeerTls
from supervisor.snapshots.replicate.receive import BuddyReceiver
from supervisor.snapshots.replicate.send import BuddySender
from tests.support.etcd import make_tls_material
from tests.support.snapshotbytes import save_step

RANKS = (0, 1)
MIB = 1 << 20


async def case(shm: Path, send_auth: Auth, keep_auth: Auth, nbytes: int, reps: int,
               rate: float | None) -> dict[str, float]:
    own, kept = Regions.create(shm), Regions.create(shm)
    table = SlotTable()
    table.decide(len(RANKS))
    sender = BuddySender(table, own.open_read, send_auth, "bench", rate=rate)
    receiver = BuddyReceiver(kept, keep_auth, host="127.0.0.1", port=0)
    times, cpu = [], 0.0
    try:
        async with anyio.create_task_group() as tg:
            port = await tg.start(receiver.run)
            sender.aim(("127.0.0.1", port), frozenset(RANKS), len(RANKS))
            for step in range(reps):
                for rank in RANKS:
                    save_step(table, own, rank, step, nbytes)
                start, start_cpu = time.perf_counter(), time.process_time()
                assert await sender.send_newest() == step
                times.append(time.perf_counter() - start)
                cpu += time.process_time() - start_cpu
            tg.cancel_scope.cancel()
    finally:
        own.close()
        kept.close()
    moved = sender.counts.bytes_sent
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "mib_per_s": moved / MIB / sum(times), "cpu_s_per_gib": cpu / (moved / (1 << 30))}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=190, help="MiB per rank (190)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rate", default="200M", help="the paced case's rate (200M)")
    parser.add_argument("--shm", default="/dev/shm")
    args = parser.parse_args()
    nbytes, shm = args.mib * MIB, Path(args.shm)
    secret = Auth(secret=b"bench secret, 32 bytes long ...")
    with tempfile.TemporaryDirectory() as tmp:
        tls = make_tls_material(Path(tmp))
        client = Auth(tls=PeerTls(str(tls.ca), str(tls.client_cert), str(tls.client_key)))
        server = Auth(tls=PeerTls(str(tls.ca), str(tls.server_cert), str(tls.server_key)))
        rate = _bytes("rate", args.rate)
        cases = [("secret, plain TCP (sendfile)", secret, secret, None),
                 ("mutual TLS", client, server, None),
                 (f"secret, --snapshot-replicate-rate {args.rate}", secret, secret, rate)]
        print(f"| case ({len(RANKS)} ranks x {args.mib} MiB, loopback, {args.reps} "
              "transfers) | transfer s (median, range) | MiB/s | CPU-s per GiB (both ends) |")
        print("|---|---|---|---|")
        for name, send_auth, keep_auth, pace in cases:
            r = await case(shm, send_auth, keep_auth, nbytes, args.reps,
                           None if pace is None else float(pace))
            print(f"| {name} | {r['median_s']:.2f} ({r['min_s']:.2f}-{r['max_s']:.2f}) | "
                  f"{r['mib_per_s']:.0f} | {r['cpu_s_per_gib']:.2f} |", flush=True)


if __name__ == "__main__":
    anyio.run(main)
