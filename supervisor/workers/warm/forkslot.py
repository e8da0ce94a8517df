"""The node's fork server over a whole run: started once, replaced when it dies or when
what it preloads changes, given up after too many failures.

``ForkSlot`` is what the warm pool talks to. Its ``run`` task (started once, by the
composition root) starts the servers; ``prepare`` (on the loop) asks for a server for a
configuration and waits until one for it is ready or has failed, so a preload goes on
when the attempt that asked for it ends; ``fork``
(in a worker thread) forks a rank's standby from the ready server, or says it cannot. A
failure of the fork server (it died, its preload crashed, a fork was refused) is never the
workers': the rank has no standby and starts cold, one warning is logged for the run, the
``failures`` counter grows (by reason, for ``/metrics``), and the next ``prepare`` starts a
new server. A preload that read a per-attempt or per-rank variable, or left a thread
running, names its module: that top-level package is left out of every later server.
"""

from __future__ import annotations

import logging
import select
import time
from collections import Counter
from collections.abc import Callable, Sequence

import anyio
from anyio.abc import TaskStatus

from supervisor.workers.guardian import Guardian
from supervisor.workers.spawn import SPAWNER, DeathSignal
from supervisor.workers.warm.forkserver import (
    Forked,
    ForkServer,
    ForkServerConfig,
    ForkServerError,
    ForkServerReport,
    Wanted,
)

logger = logging.getLogger(__name__)

MAX_FAILURES = 5  # servers that failed in a run before the slot gives up (cold starts)
EXIT_WAIT = 1.0  # s a refused fork waits to learn whether the server has exited
READY_TIMEOUT = 600.0  # s a preload may take (torch on a loaded 2-core machine: ~10 s)


class ForkSlot:
    """One fork server per node (at most two while a replacement preloads)."""

    def __init__(
        self,
        *,
        death: DeathSignal,
        prefix: list[str],
        guardian: Guardian | None = None,
        start: Callable[[ForkServerConfig], ForkServer] | None = None,
    ) -> None:
        self.death = death
        self.prefix = prefix
        self.guardian = guardian
        self._start = start or self._start_server
        self.server: ForkServer | None = None  # ready: forks come from it
        self._pending: ForkServer | None = None  # preloading (first one, or a replacement)
        self._wanted: ForkServerConfig | None = None
        self._requested = anyio.Event()  # set by ``request``
        self._settled = anyio.Event()  # set when ``run`` served or failed a request
        self._failed_for: ForkServerConfig | None = None
        self.excluded: set[str] = set()  # packages no server may preload any more
        self.failures: Counter[str] = Counter()  # reason -> count (for /metrics)
        # the last server's preload failed, and no server got ready since
        self.preload_failing = False
        self._warned = False
        self.ready_at: float | None = None  # monotonic time the current server got ready
        self.import_seconds: float | None = None  # what the last ready server's import took

    @property
    def given_up(self) -> bool:
        return sum(self.failures.values()) >= MAX_FAILURES

    @property
    def ready(self) -> bool:
        return self.server is not None and self.server.usable

    def pids(self) -> set[int]:
        """The servers' pids (a group's sweep must not kill them)."""
        return {s.pid for s in (self.server, self._pending) if s is not None}

    def importing_for(self, config: ForkServerConfig) -> float | None:
        """Seconds the server still preloading has imported for ``config``'s command (the
        first one, or a replacement), or None if none is."""
        pending = self._pending
        if pending is None or not _same_place(pending.config, config):
            return None
        return time.monotonic() - pending.started_at

    def pending_pid(self) -> int | None:
        """The pid of the server still preloading, if any."""
        return self._pending.pid if self._pending is not None else None

    def usable_for(self, config: ForkServerConfig) -> bool:
        """Whether the ready server forks standbys that run ``config``'s command."""
        server = self.server
        return server is not None and server.usable and _same_place(server.config, config)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Start the servers ``request`` asks for, one at a time, for the whole run (a
        preload is not cut short when the attempt that asked for it ends)."""
        task_status.started()
        try:
            while True:
                await self._requested.wait()
                self._requested = anyio.Event()
                config = self._wanted
                if config is not None and not self._serves(config):
                    await self._prepare(config)
                self._settled.set()
                self._settled = anyio.Event()
        finally:
            with anyio.CancelScope(shield=True):
                self.close()

    def request(self, config: ForkServerConfig) -> None:
        """Ask for a ready server for ``config`` (what is excluded left out)."""
        self._wanted = self._without_excluded(config)
        self._failed_for = None  # a new try: wait for its outcome
        self._requested.set()

    async def prepare(self, config: ForkServerConfig) -> bool:
        """``request`` and wait until it is served (True) or failed (False)."""
        self.request(config)
        wanted = self._wanted
        while True:
            if self.given_up:
                return False
            if wanted is not None and self._serves(wanted):
                return True
            if wanted is not None and self._failed_for == wanted:
                return False
            await self._settled.wait()
            wanted = self._wanted

    def _serves(self, config: ForkServerConfig) -> bool:
        server = self.server
        return server is not None and server.usable and server.config == config

    async def _prepare(self, config: ForkServerConfig) -> None:
        dead = self.server
        if dead is not None and not dead.usable:  # died since it last forked
            self.server = None
            self._discard(dead)
            self._failed("died", f"fork server (pid {dead.pid}) died: {_exit_text(dead)}")
        if self.given_up:
            return
        try:
            # On the spawner thread, which lives as long as the supervisor: the kernel sends
            # the server its death signal when the *thread* that forked it exits, and an
            # anyio worker thread is retired after 10 s idle (spawn.Spawner). (The standbys
            # are the server's forks, reparented to the process: their death signal is not
            # tied to a thread.)
            pending = await SPAWNER.spawn(self._start, config)
        except OSError as exc:
            self._failed_for = config
            self._failed("start", f"cannot start the fork server: {exc}")
            return
        self._pending = pending
        logger.debug("fork server (pid %d) started, importing %s", pending.pid,
                     ",".join([*config.preload, *(["auto"] if config.auto_names else [])]))
        try:
            with anyio.move_on_after(READY_TIMEOUT):
                await pending.ready()
            report = pending.report or ForkServerReport(False, "its preload timed out")
        except BaseException:
            self._discard(pending)
            raise
        finally:
            self._pending = None
        if not report.ok:
            self._discard(pending)
            self._failed_for = config
            self._refused(report)
            if self._wanted == config:  # again, without what it named (if it did)
                retry = self._without_excluded(config)
                if retry != config and not self.given_up:
                    self.request(retry)
            return
        old, self.server = self.server, pending
        self._failed_for, self.preload_failing = None, False
        self.ready_at = time.monotonic()
        self.import_seconds = self.ready_at - pending.started_at
        logger.info("fork server (pid %d) ready: preloaded %s in %.2f s", pending.pid,
                    ",".join([*config.preload, *(["auto"] if config.auto_names else [])])
                    or "nothing", self.import_seconds)
        if old is not None:
            self._discard(old)  # the standbys it forked are ours and stay

    def fork(self, wanted: Sequence[Wanted]) -> list[Forked | None] | None:
        """Standbys forked for ``wanted`` (in a worker thread), in its order, None for one
        the server could not fork; None if the server cannot fork at all (then those ranks
        start cold, and the next ``prepare`` replaces it)."""
        server = self.server
        if server is None:
            return None
        try:
            forked = server.fork(wanted)
        except ForkServerError as exc:
            self.server = None
            # a server killed since its last fork is most often found here, by the next
            # fork: say why it died, as _prepare would have (not just "it exited")
            died = _exited(server, within=EXIT_WAIT)
            text = (f"fork server (pid {server.pid}) died: {_exit_text(server)}" if died
                    else f"fork server (pid {server.pid}): {exc}")
            self._discard(server)
            self._failed("died" if died else "fork", text)
            return None
        return forked  # the pool registers them with the guardian

    def close(self) -> None:
        """Stop the servers (the standbys they forked are the pool's to discard)."""
        for server in (self.server, self._pending):
            if server is not None:
                self._discard(server)
        self.server = self._pending = None

    # ------------------------------------------------------------------ internals
    def _start_server(self, config: ForkServerConfig) -> ForkServer:
        server = ForkServer.start(config, self.death, self.prefix)
        if self.guardian is not None:
            self.guardian.watch(server.pid)
        return server

    def _discard(self, server: ForkServer) -> None:
        pid = server.pid
        server.stop()
        if self.guardian is not None:
            self.guardian.forget(pid)

    def _without_excluded(self, config: ForkServerConfig) -> ForkServerConfig:
        if not self.excluded:
            return config
        keep = tuple(m for m in config.preload if m.partition(".")[0] not in self.excluded)
        names = tuple(m for m in config.auto_names if m.partition(".")[0] not in self.excluded)
        exclude = frozenset(config.exclude | self.excluded)
        return ForkServerConfig(config.python, config.env, config.cwd, config.path0, keep,
                                names, exclude, config.watch)

    def _refused(self, report: ForkServerReport) -> None:
        culprit = report.tainted or (report.threaded.partition(".")[0]
                                     if report.threaded else None)
        if culprit is not None:
            self.excluded.add(culprit)
            logger.warning("fork server: %s; package %r is never preloaded in this run",
                           report.error, culprit)
            self.failures["tainted" if report.tainted else "thread"] += 1
            return
        self.preload_failing = True
        self._failed("preload", f"fork server: {report.error}")

    def _failed(self, reason: str, text: str) -> None:
        self.failures[reason] += 1
        if not self._warned:  # one warning a run; the metric counts every one
            self._warned = True
            logger.warning("%s: ranks without a standby start cold; a new fork server "
                           "will be started (this warning is not repeated)", text)
        else:  # its error was in the warning (tests count it there)
            logger.info("fork server failed again (%s)", reason)
        if self.given_up:
            logger.warning("fork server failed %d times: no more fork servers in this run",
                           sum(self.failures.values()))


def _same_place(a: ForkServerConfig, b: ForkServerConfig) -> bool:
    """Whether standbys forked by a server for ``a`` run ``b``'s command as a cold start
    would: same interpreter, node environment, working directory and ``sys.path[0]``."""
    return (a.python, a.env, a.cwd, a.path0) == (b.python, b.env, b.cwd, b.path0)


def _exited(server: ForkServer, within: float) -> bool:
    """Whether the server has exited, waiting up to ``within`` s for it (on a worker
    thread): a refused fork often comes a moment before the exit can be read."""
    if server.process.poll_exit() is not None:
        return True
    try:
        poller = select.poll()
        poller.register(server.process.pidfd, select.POLLIN)
        poller.poll(within * 1000)
    except (OSError, ValueError):  # its pidfd already closed
        pass
    return server.process.poll_exit() is not None


def _exit_text(server: ForkServer) -> str:
    status = server.process.poll_exit()
    if status is None:
        return "its socket closed"
    if status.signal is not None:
        return f"killed by signal {status.signal}"
    return f"exit code {status.exit_code}"
