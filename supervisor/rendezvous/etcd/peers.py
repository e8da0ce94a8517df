"""The lost-peer check of the etcd backends (``Rendezvous.check_peers``), at the edge.

Beside a failed group's stop, within ``within`` seconds in all: the health endpoint of
every other member of the round (URLs from the members' status summaries, as the cut-off
check reads them: ``CutoffCheck``), and whether each member's join key of the round is
still there (one read of the round's join keys: a key bound to a lease that is gone has
gone with it). The rule is ``core.peers.judge``. The cost is one etcd read and one
request per member, on a failure only.
"""

from __future__ import annotations

import logging

import anyio

from supervisor.core.peers import PeerAnswer, PeerCheck, judge
from supervisor.rendezvous.base import RendezvousResult
from supervisor.rendezvous.etcd.cutoff import CutoffCheck
from supervisor.rendezvous.etcd.keys import Keys
from supervisor.rendezvous.etcd.peer_probe import probe_peers
from supervisor.rendezvous.etcd.wire.client import EtcdClient, EtcdError

logger = logging.getLogger(__name__)


async def check_peers(client: EtcdClient, keys: Keys, peers: CutoffCheck, run_id: str,
                      node_id: str, result: RendezvousResult, within: float) -> PeerCheck:
    """The other members of round ``result``: which are confirmed gone, alive, unsure."""
    others = [m for m in result.members if m != node_id]
    if not others:
        return PeerCheck()
    deadline = anyio.current_time() + within
    leases: dict[str, bool] | None = None
    answers: list[PeerAnswer] = []

    async def read_leases() -> None:
        nonlocal leases
        prefix = keys.node(result.round, "join")
        try:
            with anyio.fail_after(within):
                found = await client.range(prefix, prefix=True, retry_window=0)
        except (EtcdError, TimeoutError) as exc:
            logger.debug("cannot read round %d's join keys: %s", result.round, exc)
            return
        present = {kv.key[len(prefix):] for kv in found.kvs}
        leases = {m: m in present for m in others}

    async def ask() -> None:
        nonlocal answers
        with anyio.move_on_after(within / 2):  # half for the URLs, the rest for the asking
            await peers.learn_all(others, result.round)
        answers = await probe_peers({m: peers.url(m) for m in others}, others, run_id,
                                    max(0.0, deadline - anyio.current_time()))

    async with anyio.create_task_group() as tg:  # each bounds itself by the deadline
        tg.start_soon(read_leases)
        tg.start_soon(ask)
    return judge(answers, leases)
