"""Chaos run checks: the invariants, read from the event log, /metrics, /status and /proc."""

from __future__ import annotations

import contextlib
import math
import os
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import anyio.to_thread
import psutil

from benchmarks.chaos_rig import (
    DESTRUCTIVE,
    ETCD_POOL_BOUND_PER_MEMBER,
    FD_BOUND,
    FD_SETTLE,
    LOST_MARKER,
    RSS_BOUND_MB,
    THREAD_BOUND,
    WAIT,
    Fault,
    Rig,
    Usage,
    etcd_connections,
    fd_change,
    live_pidfds,
    marked_processes,
    metric,
    metric_samples,
    proc_state,
)
from benchmarks.harness import log


class Checks:
    """Checks ``rig``'s run once the faults stopped; each failure is a violation."""

    def __init__(self, rig: Rig) -> None:
        self.rig = rig

    async def final_checks(self) -> None:
        await self.rig.settle()
        if self.rig.proc is None or self.rig.proc.returncode is not None:
            self.rig.violate("the supervisor is not running at the end")
            return
        async with aiohttp.ClientSession() as session:
            if await self.rig.probe(session, "GET", "/healthz") != 200:
                self.rig.violate("/healthz is not 200 at the end")
            async with session.get(self.rig.url + "/status") as resp:
                status = await resp.json()
        self.rig.tail.poll()
        await self.check_metrics()
        self.check_budget(status)
        self.check_zombies()
        await self.check_usage()

    async def check_metrics(self) -> None:
        """Every counter the faults must have moved, read once the FIFO was consumed."""
        want_rejected = dict(self.rig.fifo_expected)
        samples: dict[Any, float] = {}
        async with aiohttp.ClientSession() as session:
            with anyio.move_on_after(WAIT):
                while True:
                    async with session.get(self.rig.url + "/metrics") as resp:
                        text = await resp.text()
                    samples = metric_samples(text)
                    if all(self._rejected(samples, r) >= n for r, n in want_rejected.items()):
                        break
                    await anyio.sleep(0.05)  # pacing: the tailer reads the FIFO meanwhile
        for reason, n in want_rejected.items():
            got = self._rejected(samples, reason)
            # workers' own requests can be refused while their group stops (not owned any
            # more, or already dead); nothing but the harness sends the other kinds
            ok = got >= n if reason in ("not_owned", "dead_pid") else got == n
            if not ok:
                self.rig.violate(f"FIFO rejections {reason!r}: sent {n}, metrics count {got:g}")
        for (label, code), n in self.rig.http_sent.items():
            got = metric(samples, "elastic_supervisor_http_requests_total", path=label,
                         code=str(code))
            if got < n:
                self.rig.violate(f"HTTP {label} {code}: sent {n}, metrics count {got:g}")
        self.check_restart_metrics(samples)

    @staticmethod
    def _rejected(samples: dict[Any, float], reason: str) -> float:
        return metric(samples, "elastic_supervisor_watchdog_rejected_requests_total",
                      reason=reason)

    def expected_root_kinds(self) -> Counter[str]:
        kinds: Counter[str] = Counter()
        for f in self.rig.faults:
            if f.kind in ("crash", "sigstop+crash", "guardian-stop"):
                kinds["exited"] += 1
            elif f.kind == "sigkill":
                kinds["signaled"] += 1
            elif f.kind in ("hang", "sigstop"):
                kinds["deadline"] += 1
        return kinds

    def check_restart_metrics(self, samples: dict[Any, float]) -> None:
        want = self.expected_root_kinds()
        for kind in ("exited", "signaled", "deadline", "unhealthy"):
            failures = metric(samples, "elastic_supervisor_failures_total", kind=kind)
            restarts = metric(samples, "elastic_supervisor_restarts_total", reason=kind)
            if failures != want[kind] or restarts != want[kind]:
                self.rig.violate(f"{kind} failures: injected {want[kind]}, metrics count "
                             f"{failures:g} failures and {restarts:g} restarts")
        exits = metric(samples, "elastic_supervisor_worker_exits_total")
        if exits != len(self.rig.board.events_named("worker_exited")):
            self.rig.violate(f"worker exits: metrics {exits:g}, events "
                         f"{len(self.rig.board.events_named('worker_exited'))}")

    def check_budget(self, status: dict[str, Any]) -> None:
        scheduled = self.rig.board.events_named("restart_scheduled")
        used = status["restarts"]["used"]
        if used != len(scheduled) or used > status["restarts"]["max"]:
            self.rig.violate(f"restarts: /status says {used} of {status['restarts']['max']}, "
                         f"events say {len(scheduled)}")
        if status["restarts"]["left"] != status["restarts"]["max"] - used:
            self.rig.violate(f"restart budget: {status['restarts']}")
        if any(e.get("budget_left", 0) < 0 for e in scheduled):
            self.rig.violate("a restart was scheduled with a negative budget")
        if used != sum(self.expected_root_kinds().values()):
            self.rig.violate(f"restarts: {used} used, {sum(self.expected_root_kinds().values())} "
                         "destructive faults injected")

    def check_zombies(self) -> None:
        for child in psutil.Process(self.rig.pid).children(recursive=True):
            if proc_state(child.pid) == "Z":
                self.rig.violate(f"zombie pid {child.pid} (parent {child.ppid()}) while running")

    async def check_usage(self) -> None:
        assert self.rig.usage_start is not None
        start = self.rig.usage_start
        # the server closes the harness's connections; pooled etcd connections close
        with anyio.move_on_after(FD_SETTLE):
            while True:
                self.rig.usage_end = Usage.of(self.rig.pid, self.rig.worker_pids())
                if not self.fd_problems(start, self.rig.usage_end):
                    break
                await anyio.sleep(0.1)  # pacing
        end = self.rig.usage_end
        assert end is not None
        log(f"at the end: {end}; fds opened and closed since the baseline: "
            f"{fd_change(start, end) or 'none'}")
        for problem in self.fd_problems(start, end):
            self.rig.violate(problem)
        if end.threads > start.threads + THREAD_BOUND:
            self.rig.violate(f"threads {start.threads} -> {end.threads}")
        if end.rss_mb > start.rss_mb + RSS_BOUND_MB:
            self.rig.violate(f"RSS {start.rss_mb:.1f} -> {end.rss_mb:.1f} MB")
        if end.children != start.children:
            self.rig.violate(f"children {start.children} -> {end.children}")

    def fd_problems(self, start: Usage, end: Usage) -> list[str]:
        """What is wrong with the fds at ``end`` (empty: nothing): more than FD_BOUND over
        the start besides connections to etcd members and pidfds of live processes, more
        than ETCD_POOL_BOUND_PER_MEMBER over the start per member to those (``chaos_rig``),
        or a connection its peer closed still open."""
        members = self.rig.etcd_members()
        pooled = etcd_connections(start, members), etcd_connections(end, members)
        kept = pooled[0] + live_pidfds(start), pooled[1] + live_pidfds(end)
        out = []
        if end.fds - kept[1] > start.fds - kept[0] + FD_BOUND:
            out.append(f"fds {start.fds} -> {end.fds}, {pooled[0]} -> {pooled[1]} of them to "
                       f"etcd ({fd_change(start, end)})")
        if pooled[1] > pooled[0] + ETCD_POOL_BOUND_PER_MEMBER * len(members):
            out.append(f"connections to etcd {pooled[0]} -> {pooled[1]} "
                       f"({fd_change(start, end)})")
        if half_closed := [kind for kind in end.fd_kinds if kind.endswith(" CLOSE_WAIT")]:
            out.append(f"connections closed by their peer and kept open: {half_closed}")
        return out

    async def check_orphans(self) -> None:
        found: list[int] = []
        with anyio.move_on_after(2):  # the kernel finishes SIGKILLs; nothing should be left
            while found := [p for p in marked_processes(self.rig.mark) if proc_state(p) != "Z"]:
                await anyio.sleep(0.05)  # pacing
        self.rig.orphans = found
        for pid in found:
            cmd = psutil.Process(pid).cmdline() if psutil.pid_exists(pid) else []
            self.rig.violate(f"orphan pid {pid} after the supervisor exited: {' '.join(cmd)}")
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    def check_foreign(self) -> int:
        signalled = 0
        for pid, sigs in self.rig.foreign.items():
            state = proc_state(pid)
            got = sigs.read_text().split()
            if state is None or state in ("Z", "X"):
                self.rig.violate(f"foreign pid {pid} died")
            elif state == "T":
                self.rig.violate(f"foreign pid {pid} was stopped")
            if got:
                signalled += 1
                self.rig.violate(f"foreign pid {pid} received signals {got}")
        return signalled

    def check_events(self) -> None:
        exits = {e["pid"]: e for e in self.rig.board.events_named("worker_exited")}
        stopping = self.rig.board.events_named("group_stopping")
        for f in self.rig.faults:
            if f.kind in DESTRUCTIVE:
                self._check_destructive(f, exits, stopping)
            elif f.kind == "flood":
                self._check_flood(f)
            elif f.kind == "diskfull":
                self._check_diskfull(f)
            elif f.kind == "frozen":
                self._check_frozen(f)
            elif f.kind == "grandchild" and psutil.pid_exists(f.victim or 0) \
                    and proc_state(f.victim or 0) not in ("Z", None):
                f.problems.append(f"grandchild {f.victim} still alive")
        if len(self.rig.board.events_named("signal_forwarded")) != self.rig.n_sigusr1:
            self.rig.violate(f"SIGUSR1 sent {self.rig.n_sigusr1} times, "
                         f"{len(self.rig.board.events_named('signal_forwarded'))} forwarded")
        if len(self.rig.board.events_named("logs_reopened")) != self.rig.n_sighup:
            self.rig.violate(f"SIGHUP sent {self.rig.n_sighup} times, "
                         f"{len(self.rig.board.events_named('logs_reopened'))} reopens")
        for f in self.rig.faults:
            for problem in f.problems:
                self.rig.violate(f"{f.kind} at restart {f.detail.get('restart')}: {problem}")
        self.check_attempt_dirs()

    def _check_destructive(self, f: Fault, exits: dict[int, Any], stopping: list[Any]) -> None:
        exited = exits.get(f.victim or 0)
        if exited is None:
            f.problems.append(f"no worker_exited event for pid {f.victim}")
            return
        if f.kind in ("crash", "guardian-stop") and \
                exited.get("exit_code") != f.detail["exit_code"]:
            f.problems.append(f"pid {f.victim} exit {exited} != code {f.detail['exit_code']}")
        # a hung worker may take the group stop's SIGTERM (its handler exits 143) before
        # the watchdog's SIGKILL; a stopped one can only die by SIGKILL
        killed = exited.get("signal") == "SIGKILL" or (
            f.kind == "hang" and exited.get("exit_code") == 143)
        if f.kind in ("sigkill", "hang", "sigstop", "sigstop+crash") and not killed:
            f.problems.append(f"pid {f.victim} did not die by SIGKILL: {exited}")
        if f.kind == "sigstop+crash":
            other = exits.get(f.detail["other"])
            if other is None or other.get("exit_code") != f.detail["exit_code"]:
                f.problems.append(f"crashed pid {f.detail['other']}: {other}")
        root_pid = f.detail.get("other", f.victim)
        word = "deadline" if f.kind in ("hang", "sigstop") else \
            "killed by SIGKILL" if f.kind == "sigkill" else "exited with code"
        if not any(f"(pid {root_pid})" in str(e.get("root_cause")) and word in
                   str(e.get("root_cause")) for e in stopping):
            f.problems.append(f"no group_stopping with root cause '{word}' for pid {root_pid}")

    def _check_flood(self, f: Fault) -> None:
        dirs = {e["dir"] for e in self.rig.board.events_named("group_started")
                if f.victim in e["pids"].values()}
        last = f"flood {f.detail['tag']} {f.detail['lines'] - 1} ".encode()
        for d in dirs:
            log_file = Path(d) / str(f.detail["rank"]) / "stdout.log"
            if log_file.exists() and last in log_file.read_bytes():
                return
        f.problems.append(f"the flood's last line is not in rank {f.detail['rank']}'s stdout.log")

    def _check_diskfull(self, f: Fault) -> None:
        dirs = {e["dir"] for e in self.rig.board.events_named("group_started")
                if f.victim in e["pids"].values()}
        last = f"flood {f.detail['tag']} 9 ".encode()
        for d in dirs:
            log_file = Path(d) / str(f.detail["rank"]) / "stdout.log"
            data = log_file.read_bytes() if log_file.exists() else b""
            end = data.find(last)
            if end >= 0 and data.rfind(LOST_MARKER, 0, end) >= 0:
                return
        f.problems.append(f"rank {f.detail['rank']}'s stdout.log has no lost-output marker "
                          "followed by the flood written after the disk was freed")

    def _check_frozen(self, f: Fault) -> None:
        # a worker of the frozen group may die later, by a later fault (a SIGSTOPped
        # worker's loop deadline expires): only an expiry between the freeze and the
        # group's answer to SIGUSR1 is this fault's doing
        until = f.detail.get("confirmed", math.inf)
        hung = [e for e in self.rig.board.events_named("deadline_expired")
                if e.get("pid") in f.detail["pids"] and f.at <= e.get("mono", 0) <= until]
        if hung:
            f.problems.append(f"killed as hung after the freeze: {hung}")
        if b"event loop stalled" not in (self.rig.root / "supervisor.err").read_bytes():
            f.problems.append("the supervisor did not report its stall")

    def check_attempt_dirs(self) -> None:
        for e in self.rig.board.events_named("group_started"):
            for rank in range(self.rig.args.workers):
                for name in ("stdout.log", "stderr.log"):
                    if not (Path(e["dir"]) / str(rank) / name).is_file():
                        self.rig.violate(f"missing {e['dir']}/{rank}/{name}")
