"""etcd watches that cannot go blind, and the prefix views built on them.

A watch stream (``stream``) is one streaming ``POST /v3/watch`` to one member through
etcd's JSON gateway. Left alone, such a stream says nothing when its member is cut off,
has lost its raft leader, or was restarted while the network was down (the old connection
is then dead on etcd's side only): it simply stays silent. So a ``Watch`` does not depend
on one member (measured against etcd 3.4, see docs/rendezvous.md, "Watches that cannot go
blind"):

- **Two streams on two members.** With more than one endpoint, a watch keeps a second
  stream open on a member other than the first one's and delivers the merge: every
  batch goes through one filter that passes only events at or after ``next_revision``
  (the last delivered revision + 1; etcd sends a revision's events in one message), so
  each event is delivered once, in order, whichever stream brought it first. When one
  member goes quiet without an error, the other stream still delivers within
  milliseconds; the quiet stream is moved by the checks below, resuming from the last
  delivered revision + 1. With one endpoint there is one stream.
- **The leader requirement.** Every stream is opened with ``Grpc-Metadata-hasleader:
  true``, so a member without a leader refuses it at once (``etcdserver: no leader``,
  ~15 ms) instead of accepting a watch it will never feed.
- **Each stream checks its member.** Every ``check_interval`` (the client's request
  timeout) without a message, a stream looks at what the client learnt about its member:
  when the latest request to it failed, the stream moves; the first stream also follows
  the requests (when they moved to a member no stream is on). When nothing reached its
  member for two intervals, it asks the member itself (``EtcdClient.probe``: a
  linearizable read, which needs the member's leader and quorum). A member that does not
  answer in time is left.
- **A stream behind the other is checked sooner.** When the other stream brings a
  revision this one has not, this one gets ``LAG`` s (not the rest of its interval) to
  bring it too, as a healthy member does within milliseconds; still behind and silent
  then, it moves. This does not wait for the watch's reader to take the news.
- **Requests follow the news.** The member whose stream brought a revision first becomes
  the client's preferred one: the request the news prompts (a campaign, a new round)
  does not first wait out the hedge on a member that went quiet. When the first
  stream's member brings the same revision, requests go back to it.
- **TCP keepalive** on each stream's socket (idle = the interval, 3 probes): a connection
  whose far end vanished (etcd restarted during a cut, a middlebox forgot it) breaks
  within about two intervals even when no request is in flight.

The two streams never sit on the same member. The watch is ``live`` while at least one
stream is open; ``on_live`` hears the watch's liveness each time a stream opens or closes.
An outage (no member answered) is declared by the first stream only, and only while the
second is not open either. After an outage a watch asks its owner to re-read
(``WatchResync``): a ``PrefixView`` then reads the whole prefix again and re-opens its
watch from the fresh revision, so nothing it decides on predates the outage.
The gateway's WebSocket transport would allow progress requests on the stream, but it
forwards neither the leader header nor the ``Authorization`` header (etcd 3.4's
grpc-websocket-proxy): so the streams stay plain POSTs.
"""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Literal

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from supervisor.rendezvous.etcd.wire.client import (
    EtcdClient,
    EtcdCompacted,
    EtcdError,
    EtcdUnavailable,
    JsonDict,
    KeyValue,
    WatchEvent,
    _EndpointDown,
    _key_range,
)
from supervisor.rendezvous.etcd.wire.stream import (
    KEEPALIVE_PROBES,
    LEADER_HEADER,
    WatchStream,
    set_keepalive,
)

__all__ = ["KEEPALIVE_PROBES", "LEADER_HEADER", "LiveHook", "PrefixView", "Watch",
           "WatchResync", "open_prefix_view", "open_watch", "set_keepalive"]

logger = logging.getLogger(__name__)

STREAMS = 2  # streams per watch, on as many members (fewer endpoints: one per endpoint)
BACKLOG = 64  # batches read but not yet delivered; a stream that is this far ahead waits
# seconds a silent stream may be behind the other before it leaves its member (a healthy
# member streams a revision within milliseconds of another)
LAG = 0.5
CLOCK_SLACK = 0.001  # a timer may fire this much before its deadline

LiveHook = Callable[[bool], None]  # a stream opened or closed: is the watch live now?
# what a stream hands to the watch's reader: (its member, a batch), or its error
_Item = tuple[str | None, list[WatchEvent]] | EtcdError


class WatchResync(EtcdError):
    """etcd was unreachable since the watch last delivered: re-read before trusting it."""


class _Quiet(Exception):
    """The stream's member stopped answering or the client's requests moved elsewhere."""


class Watch:
    """A watch on a key range that yields batches of events, each event once and in
    revision order, from one or two streams on different members (module docstring).

    Use as ``async with Watch(...) as watch: async for events in watch``: the streams open
    when the block is entered and close when it exits. ``check_interval`` (default: the
    client's request timeout) is how often a quiet stream checks its member."""

    def __init__(self, client: EtcdClient, key_range: JsonDict, start_revision: int, *,
                 check_interval: float | None = None,
                 on_live: LiveHook | None = None) -> None:
        self._client = client
        self._on_live = on_live
        self._probe_key = base64.b64decode(key_range["key"]).decode()
        self.next_revision = start_revision
        self.check_interval = check_interval or client.timeout
        self.moves = 0  # times a stream left a member that went quiet
        self._outages_seen = client.reachability.outages
        count = min(STREAMS, len(client.endpoints))
        self._streams = [WatchStream(client, key_range, self.check_interval)
                         for _ in range(count)]
        # per stream: the newest revision it handed over (or resumed after), since when
        # another stream has brought a newer one (None: it is not behind), and the scope
        # of the read it waits in (None: it is not reading)
        self._brought = [start_revision - 1] * count
        self._behind_since: list[float | None] = [None] * count
        self._reads: list[anyio.CancelScope | None] = [None] * count
        # made on entry: an unclosed memory stream warns when collected
        self._send: MemoryObjectSendStream[_Item] | None = None
        self._receive: MemoryObjectReceiveStream[_Item] | None = None
        self._tg: TaskGroup | None = None
        self._error: EtcdError | None = None

    async def __aenter__(self) -> Watch:
        self._send, self._receive = anyio.create_memory_object_stream[_Item](BACKLOG)
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        for slot in range(len(self._streams)):
            self._tg.start_soon(self._run_stream, slot)
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        tg, self._tg = self._tg, None
        try:
            if tg is None:
                return None
            tg.cancel_scope.cancel()
            if e is None or isinstance(e, anyio.get_cancelled_exc_class()):
                return await tg.__aexit__(et, e, tb)
            # the block's own error goes on as it is, not wrapped in an ExceptionGroup
            await tg.__aexit__(None, None, None)
            return None
        finally:
            for stream in self._streams:
                stream.close()
            for end in (self._send, self._receive):
                if end is not None:
                    end.close()

    def __aiter__(self) -> Watch:
        return self

    async def __anext__(self) -> list[WatchEvent]:
        if self._tg is None or self._receive is None:
            raise RuntimeError("enter the watch (async with) before iterating it")
        while True:
            if self._error is not None:
                raise self._error
            item = await self._receive.receive()
            if isinstance(item, EtcdError):
                self._error = item
                continue
            # the merge: etcd sends all of a revision's events in one message, so a filter
            # on the revision never splits one; what it drops, the other stream brought
            member, batch = item
            fresh = [ev for ev in batch if ev.kv.mod_revision >= self.next_revision]
            stats = self._client.stats
            stats.watch_duplicates += len(batch) - len(fresh)
            if not fresh:
                self._caught_up(member)
            else:
                self._first_with_news(member)
                stats.watch_events += len(fresh)
                stats.watch_bytes += sum(len(ev.kv.value) for ev in fresh)
                self.next_revision = fresh[-1].kv.mod_revision + 1
                return fresh

    def _first_with_news(self, member: str | None) -> None:
        """The member whose stream brought a revision first is up to date: the client's
        next request goes there. When the others' member went quiet (isolated, or
        electing a leader), the request this news prompts (a campaign, a new round) then
        does not first wait out the hedge on it."""
        self._prefer(member)

    def _caught_up(self, member: str | None) -> None:
        """The first stream's member brought what the other had brought: it is up to
        date too, and requests go back to it (the member the first stream follows). So
        between healthy members the preference moves only for the milliseconds one stream
        is ahead, and a member that goes quiet is still found by a request of its own
        failing (the lease refresh), not only by the probe."""
        if member == self._streams[0].endpoint:
            self._prefer(member)

    def _prefer(self, member: str | None) -> None:
        client = self._client
        if member is not None and member != client.preferred \
                and not client.endpoint_health(member).failing:
            client._prefer(member)

    @property
    def live(self) -> bool:
        """Whether a stream is open on a member that answers (as far as the checks know)."""
        return any(stream.live for stream in self._streams)

    @property
    def endpoints(self) -> tuple[str, ...]:
        """The members the open streams are on (the first stream's first)."""
        return tuple(s.endpoint for s in self._streams if s.live and s.endpoint is not None)

    @property
    def endpoint(self) -> str | None:
        """A member an open stream is on (the first stream's, if it is open)."""
        endpoints = self.endpoints
        return endpoints[0] if endpoints else None

    async def _run_stream(self, slot: int) -> None:
        """Keep stream ``slot`` open on some member and hand over what it reads, until
        the watch closes or fails (an error is handed over too)."""
        try:
            while True:
                await self._open(slot)
                try:
                    self._check_outage()
                    await self._pump(slot)
                except _EndpointDown as exc:
                    logger.info("etcd watch stream on %s broke (%s); reconnecting",
                                self._streams[slot].endpoint, exc)
                except _Quiet as exc:
                    logger.warning("etcd watch leaves %s: %s", self._streams[slot].endpoint,
                                   exc)
                    self.moves += 1
                finally:
                    self._streams[slot].close()
                    self._changed()
        except EtcdError as exc:
            assert self._send is not None
            await self._send.send(exc)

    async def _pump(self, slot: int) -> None:
        """Hand over each message's events; check the member every quiet interval, or
        ``LAG`` s after the other stream brought what this one has not."""
        stream = self._streams[slot]
        while True:
            events: list[WatchEvent] | None = None
            with anyio.CancelScope(deadline=self._read_deadline(slot)) as scope:
                self._reads[slot] = scope
                events = await stream.read()
            self._reads[slot] = None
            if events is None:
                self._check_outage()
                await self._check_member(slot)
            elif events:
                assert self._send is not None
                self._brought[slot] = max(self._brought[slot], events[-1].kv.mod_revision)
                self._note_behind()
                await self._send.send((stream.endpoint, events))

    def _read_deadline(self, slot: int) -> float:
        """When a read of stream ``slot`` gives up: after the quiet interval, or when it
        has been behind the other stream for ``LAG`` s (a read that starts that late
        still gets ``LAG`` s, so what its member already sent is read before a check)."""
        now = anyio.current_time()
        deadline = now + self.check_interval
        since = self._behind_since[slot]
        if since is not None:
            due = since + LAG
            deadline = min(deadline, due if due > now else now + LAG)
        return deadline

    def _note_behind(self) -> None:
        """After a stream brought a revision (or resumed): note which streams are behind
        now, and cut a newly behind stream's read short (``_read_deadline``)."""
        newest, now = max(self._brought), anyio.current_time()
        for other, brought in enumerate(self._brought):
            if brought >= newest:
                self._behind_since[other] = None
            elif self._behind_since[other] is None:
                self._behind_since[other] = now
                read = self._reads[other]
                if read is not None:
                    read.deadline = min(read.deadline, now + LAG)

    def _changed(self) -> None:
        if self._on_live is not None:
            self._on_live(self.live)

    def _check_outage(self) -> None:
        """An outage came and went since the stream last delivered: the owner must re-read
        (the keys may have changed in ways a resumed stream would only replay slowly, and
        a lease expired meanwhile changes what this agent may write)."""
        outages = self._client.reachability.outages
        if outages != self._outages_seen:
            self._outages_seen = outages
            raise WatchResync("etcd was unreachable since this watch last delivered")

    def _sibling(self, slot: int) -> WatchStream | None:
        others = [s for i, s in enumerate(self._streams) if i != slot]
        return others[0] if others else None

    async def _check_member(self, slot: int) -> None:
        """Raise ``_Quiet`` if stream ``slot``'s member should be left (module docstring)."""
        client, endpoint = self._client, self._streams[slot].endpoint
        assert endpoint is not None
        health = client.endpoint_health(endpoint)
        preferred = client.preferred
        # the first stream follows the requests; the second stands elsewhere on purpose
        if slot == 0 and preferred not in self.endpoints \
                and not client.endpoint_health(preferred).failing:
            raise _Quiet(f"requests moved to {preferred}")
        if health.failing:
            raise _Quiet("its latest request failed")
        # the other stream brought news this one has not brought for LAG s (a healthy
        # member streams a revision within milliseconds of another)
        since = self._behind_since[slot]
        if since is not None and anyio.current_time() - since >= LAG - CLOCK_SLACK:
            raise _Quiet(f"another member delivered revision {max(self._brought)}, "
                         f"it did not in {LAG:g}s")
        # the lease keepalive (every TTL/3) usually answers for the first stream's member:
        # probe only when nothing did for two intervals
        if time.monotonic() - health.last_ok > 2 * self.check_interval:
            try:
                await client.probe(endpoint, self._probe_key)
            except EtcdUnavailable as exc:
                client._avoid(endpoint)
                raise _Quiet(f"it did not answer a read in {client.timeout:g}s ({exc})") from exc

    def _candidates(self, slot: int) -> list[str]:
        """Where stream ``slot`` may open: every member but the other stream's, the first
        stream starting at the member requests go to, the second at the one after it."""
        rotation = list(self._client._rotation())
        if slot > 0:
            rotation = rotation[1:] + rotation[:1]
        sibling = self._sibling(slot)
        taken = sibling.endpoint if sibling is not None else None
        return [endpoint for endpoint in rotation if endpoint != taken]

    async def _open(self, slot: int) -> None:
        """Open stream ``slot`` on the first candidate member that takes it. When none
        does: while the other stream is open, or for the second stream, back off and try
        again; the first stream alone declares the outage and gives up after the client's
        ``retry_window``."""
        client, stream, delay = self._client, self._streams[slot], 0.05
        window = client.retry_window
        if window is not None:
            window = max(window, client.timeout)
        while True:
            failures: list[str] = []
            began = time.monotonic()
            for endpoint in self._candidates(slot):
                try:
                    await stream.connect(endpoint, self.next_revision)
                except _EndpointDown as exc:
                    failures.append(f"{endpoint}: {exc}")
                    client.endpoint_health(endpoint).failed()
                    client._avoid(endpoint)
                    continue
                if slot == 0:
                    client._prefer(endpoint)
                # it resumes from there; if that is behind the other, counted from now
                self._brought[slot], self._behind_since[slot] = self.next_revision - 1, None
                self._note_behind()
                self._changed()
                return
            sibling = self._sibling(slot)
            if slot == 0 and not (sibling is not None and sibling.live):
                # A watch that connects proves little, so only failures count towards the
                # outage; the next unary answer ends it.
                client._unreached("; ".join(failures), began)
                remaining = client._may_retry(window)
                if remaining <= 0:
                    age = client.reachability.outage_age(time.monotonic())
                    raise EtcdUnavailable(f"etcd watch could not reconnect for {age:.1f}s "
                                          f"({'; '.join(failures)})")
                await anyio.sleep(min(delay, remaining))  # every member is down: back off
            else:
                await anyio.sleep(delay)
            delay = min(delay * 2, 1.0)


def open_watch(client: EtcdClient, key: str, *, prefix: bool = False, start_revision: int,
               on_live: LiveHook | None = None, check_interval: float | None = None
               ) -> Watch:
    """Watch the key (or prefix) from ``start_revision``: ``async with open_watch(client, ...)
    as w: async for events in w``. With more than one endpoint the watch keeps streams
    on two members and delivers each event once; a stream reconnects to any endpoint,
    resuming after the last event delivered, for up to the client's ``retry_window``
    seconds per outage; then ``EtcdUnavailable``. After an outage it raises
    ``WatchResync``: re-read, then watch again from the fresh revision. ``on_live`` hears
    the watch's liveness whenever a stream opens or closes; ``check_interval`` (default:
    the client's ``timeout``) is how often a silent stream checks its member."""
    return Watch(client, _key_range(key, prefix), start_revision, on_live=on_live,
                 check_interval=check_interval)


def _prefix_range(prefix: str) -> JsonDict:
    return _key_range(prefix, True)


class PrefixView:
    """A local copy of every key under a prefix, kept current by one watch.

    Open with :func:`open_prefix_view`. ``kvs`` maps full keys to values as of
    ``revision``; :meth:`wait_changed` returns after an update. After an outage the view
    reads the prefix again and re-opens its watch from that fresh revision.
    """

    def __init__(self, client: EtcdClient, prefix: str, *,
                 on_live: LiveHook | None = None) -> None:
        self.client = client
        self.prefix = prefix
        self._on_live = on_live
        self.kvs: dict[str, KeyValue] = {}
        self.revision = 0
        self.version = 0  # bumped on every update; pass it to wait_changed
        self.resyncs = 0  # re-reads after an outage
        self._changed = anyio.Event()
        self._error: EtcdError | None = None
        self._watch: Watch | None = None

    @property
    def watch_live(self) -> bool:
        """Whether the view's watch stream is open on a member that answers."""
        return self._watch is not None and self._watch.live

    @property
    def watch_endpoint(self) -> str | None:
        """A member the view's watch has a stream open on (None: none)."""
        return self._watch.endpoint if self._watch is not None else None

    @property
    def watch_endpoints(self) -> tuple[str, ...]:
        """Every member the view's watch has a stream open on."""
        return self._watch.endpoints if self._watch is not None else ()

    async def refresh(self, *, retry_window: float | Literal["default"] | None = "default"
                      ) -> None:
        """Re-read the whole prefix now (after a write, so decisions see its effect)."""
        result = await self.client.range(self.prefix, prefix=True, retry_window=retry_window)
        if result.revision > self.revision:
            self.kvs = {kv.key: kv for kv in result.kvs}
            self.revision = result.revision
            self._notify()

    async def wait_changed(self, since: int | None = None) -> None:
        """Wait until ``version`` moves past ``since`` (default: now); raise the watch's
        error if it failed for good. Read ``version`` with the state you decided on, so an
        update in between is not missed."""
        since = self.version if since is None else since
        while self.version <= since and self._error is None:
            await self._changed.wait()
        if self._error is not None:
            raise self._error

    async def wait_revision(self, revision: int) -> None:
        """Wait until the view has applied ``revision`` (a write of ours under the prefix):
        the watch brings it, so no re-read is needed."""
        while self.revision < revision and self._error is None:
            await self._changed.wait()
        if self._error is not None:
            raise self._error

    def poke(self) -> None:
        """Wake every ``wait_changed`` as if the prefix had changed: its owner's own state
        did (for example its lease was replaced), so waiters should look again."""
        self._notify()

    def _notify(self) -> None:
        self.version += 1
        self._changed.set()
        self._changed = anyio.Event()

    def _apply(self, events: list[WatchEvent]) -> None:
        # One txn's events share a revision: filter against the revision before the batch.
        floor = self.revision
        fresh = [ev for ev in events if ev.kv.mod_revision > floor]
        for ev in fresh:
            if ev.type == "DELETE":
                self.kvs.pop(ev.kv.key, None)
            else:
                self.kvs[ev.kv.key] = ev.kv
            self.revision = ev.kv.mod_revision
        if fresh:
            self._notify()

    async def _resync(self, why: str) -> None:
        """Read everything again, from a fresh revision (after an outage, or when the
        watch's start revision was compacted away)."""
        result = await self.client.range(self.prefix, prefix=True)
        self.kvs = {kv.key: kv for kv in result.kvs}
        self.revision = max(self.revision, result.revision)
        self.resyncs += 1
        logger.info("etcd %s re-read %s at revision %d (%d key(s))",
                    self.prefix, why, self.revision, len(self.kvs))
        self._notify()

    async def _follow(self) -> None:
        reread = ""
        while True:
            try:
                if reread:  # inside the try: a re-read that fails ends the view like a watch
                    await self._resync(reread)
                    reread = ""
                async with Watch(self.client, _prefix_range(self.prefix), self.revision + 1,
                                 on_live=self._on_live) as watch:
                    self._watch = watch
                    async for events in watch:
                        self._apply(events)
            except WatchResync:
                reread = "after the outage"
            except EtcdCompacted:
                reread = "after its history was compacted"
            except EtcdError as exc:
                self._error = exc
                self._notify()
                return
            finally:
                self._watch = None


@asynccontextmanager
async def open_prefix_view(client: EtcdClient, prefix: str, *,
                           retry_window: float | Literal["default"] | None = "default",
                           on_live: LiveHook | None = None,
                           ) -> AsyncIterator[PrefixView]:
    """Read ``prefix`` (retrying for ``retry_window``) and follow it by watch until the
    block exits; ``on_live`` hears the watch's liveness each time one of its streams
    opens or closes."""
    view = PrefixView(client, prefix, on_live=on_live)
    await view.refresh(retry_window=retry_window)
    body_error: BaseException | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(view._follow)
        try:
            yield view
        except BaseException as exc:  # re-raised below, not wrapped in an ExceptionGroup
            body_error = exc
        finally:
            tg.cancel_scope.cancel()
    if body_error is not None:
        raise body_error
