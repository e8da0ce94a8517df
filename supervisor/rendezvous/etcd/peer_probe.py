"""Ask peers' health endpoints whether they are there, at the edge (the rule:
``core.peers.judge``).

One ``GET /status`` per peer, all at once, the whole bounded by the caller: a connection
refused is a peer whose supervisor is gone (its host answers, nothing listens); a status
document of the same job is a peer that is alive; anything else, a timeout included, is
ambiguous. A peer's answer is untrusted input: only its ``run_id`` is read, from at most
``MAX_STATUS`` bytes.
"""

from __future__ import annotations

import errno
import json
import logging
from collections.abc import Mapping, Sequence

import aiohttp
import anyio

from supervisor.core.peers import PeerAnswer, Seen

logger = logging.getLogger(__name__)

MAX_STATUS = 64 * 1024  # bytes read of a peer's /status at most


async def probe_peers(urls: Mapping[str, str | None], peers: Sequence[str], run_id: str,
                      within: float) -> list[PeerAnswer]:
    """What each of ``peers`` (node ids; ``urls`` gives their health URLs) did within
    ``within`` seconds; a peer that had not answered by then is ``NO_ANSWER``."""
    seen: dict[str, PeerAnswer] = {}
    asked = [p for p in peers if urls.get(p)]
    if asked:
        # no pooled connection: a reused one could hide a peer that is gone
        connector = aiohttp.TCPConnector(force_close=True, limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            with anyio.move_on_after(within):
                async with anyio.create_task_group() as tg:
                    for peer in asked:
                        tg.start_soon(_ask_into, seen, session, peer, str(urls[peer]), run_id)
    return [seen.get(p) or PeerAnswer(p, Seen.NO_ANSWER if urls.get(p) else Seen.NO_URL,
                                      urls.get(p) or "")
            for p in peers]


async def _ask_into(seen: dict[str, PeerAnswer], session: aiohttp.ClientSession, peer: str,
                    url: str, run_id: str) -> None:
    seen[peer] = PeerAnswer(peer, await ask_peer(session, url, run_id), url)


async def ask_peer(session: aiohttp.ClientSession, url: str, run_id: str) -> Seen:
    """What the health endpoint at ``url`` did (unbounded: the caller bounds it)."""
    try:
        async with session.get(url + "/status") as resp:
            body = await resp.content.read(MAX_STATUS)
        doc = json.loads(body)
    except aiohttp.ClientConnectorError as exc:
        if exc.os_error.errno == errno.ECONNREFUSED:
            return Seen.REFUSED
        logger.debug("peer at %s did not answer: %s", url, exc)
        return Seen.NO_ANSWER
    except (aiohttp.ClientError, OSError, ValueError, RecursionError) as exc:
        logger.debug("peer at %s did not answer: %s", url, exc)
        return Seen.NO_ANSWER
    if isinstance(doc, dict) and doc.get("run_id") == run_id:
        return Seen.ANSWERED
    return Seen.NO_ANSWER  # another job's supervisor took the port: not a sign of ours
