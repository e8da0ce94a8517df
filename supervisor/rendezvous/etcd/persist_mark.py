"""The persist mark of ``--snapshot-dir`` in the job's etcd (``ctl/persist``, see
``etcd.wire.jobstep``): written by group rank 0 once per interval, followed by every node."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import msgspec

from supervisor.errors import RendezvousError
from supervisor.rendezvous.base import EtcdService
from supervisor.rendezvous.etcd.wire.client import EtcdError
from supervisor.rendezvous.etcd.wire.decode import decode
from supervisor.rendezvous.etcd.wire.jobstep import PersistMark

logger = logging.getLogger(__name__)


class PersistMarks:
    """The persist mark in the job's etcd (``snapshots.service`` writes and follows it)."""

    NAME = "persist"

    def __init__(self, etcd: EtcdService) -> None:
        self.etcd = etcd

    async def put(self, step: int, round_: int) -> None:
        await self.etcd.put_control(self.NAME, msgspec.json.encode(
            PersistMark(step, round_)).decode())

    async def follow(self) -> AsyncIterator[PersistMark]:
        """Every new mark (one that does not decode is counted and skipped)."""
        last = -1
        try:
            async for kv in self.etcd.control_changes(self.NAME):
                if kv is None or kv.mod_revision == last:
                    continue
                last = kv.mod_revision
                mark = decode("ctl/persist", kv.key, kv.value, PersistMark)
                if mark is not None:
                    yield mark
        except (EtcdError, RendezvousError) as exc:  # the rendezvous gave up: it says why
            logger.debug("persist marks: no longer followed: %s", exc)
