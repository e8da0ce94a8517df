"""Rank 0's store as a warm restart sees it: whether rank 0, when it runs on this node,
had its store listening on MASTER_PORT (learned at a stop), and where a preloaded warm
rank then waits for it before the user's code dials it (``core.warm.store_to_await``).
"""

from __future__ import annotations

import errno
import logging
import socket

from supervisor.core.envs import GroupLayout
from supervisor.core.warm import store_to_await

logger = logging.getLogger(__name__)


class RankZeroStore:
    """What this node learned of rank 0's store (a store of its own per attempt: nothing
    is reused, only waited for)."""

    def __init__(self) -> None:
        self.seen = False  # rank 0's store listened on MASTER_PORT in an earlier attempt

    def learn(self, layout: GroupLayout) -> None:
        """Note whether rank 0 (if it runs here) has its store listening on MASTER_PORT."""
        if not self.seen and layout.rank_offset == 0:
            self.seen = port_listening(layout.master_port)
            if self.seen:
                logger.debug("rank 0 hosts a store on port %d: warm ranks will wait for it",
                             layout.master_port)

    def wait_for(self, layout: GroupLayout, global_rank: int) -> tuple[str, int, float] | None:
        """Where ``global_rank``, started warm, waits for the store (None: it does not)."""
        return store_to_await(self.seen, layout.rank_offset, global_rank,
                              (layout.master_addr, layout.master_port))


def port_listening(port: int) -> bool:
    """Whether something of this host holds ``port`` (rank 0's store listening on it).

    A bind test, not a read of ``/proc/net/tcp``: that table holds every connection of the
    host (thousands under a busy health endpoint) and took milliseconds of the loop at
    every stop. Binding the wildcard address (with ``SO_REUSEADDR``, so connections in
    TIME_WAIT do not count) fails while any socket listens on the port."""
    for family, address in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 here
        try:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((address, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
        finally:
            probe.close()
    return False
