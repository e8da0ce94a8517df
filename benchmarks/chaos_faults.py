"""Chaos run faults: what is injected, one destructive fault at a time plus background noise."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import anyio
import anyio.to_thread

from benchmarks.chaos_rig import (
    DESTRUCTIVE,
    ETCD_OUTAGE,
    ETCD_TTL,
    FREEZE,
    HANG_DEADLINE,
    WAIT,
    Fault,
    Rig,
    Usage,
    fill_disk,
    has_mark,
    log,
    proc_state,
)
from supervisor.core.deadlines import PIPE_BUF, Rejected, parse_request
from supervisor.health.server import REQUEST_DEADLINE


def fifo_lines(rng: random.Random, targets: dict[str, int]) -> list[tuple[bytes, str]]:
    """Garbage and forged deadline requests, each with the rejection reason it must get."""
    now = time.time()
    out: list[tuple[bytes, str]] = []

    def forged(target: int, **over: Any) -> bytes:
        obj = {"version": 1, "pid": target, "scope_id": f"chaos{rng.randrange(10**6)}",
               "expiration_time": now - rng.random() * 10, "signal": int(signal.SIGKILL)}
        obj.update(over)
        return json.dumps(obj).encode()

    for _ in range(rng.randint(3, 12)):
        roll = rng.random()
        if roll < 0.2:
            line = bytes(rng.randrange(256) for _ in range(rng.randint(1, 300)))
        elif roll < 0.35:
            value = rng.choice([[], [1, 2], "x", 3.5, None, True, {"a": 1}, "{" * 50])
            line = json.dumps(value).encode()
        elif roll < 0.5:
            field_name = rng.choice(["version", "pid", "scope_id", "expiration_time", "signal"])
            line = forged(targets["foreign"], **{field_name: rng.choice(["1", None, [1], True])})
        elif roll < 0.6:
            bad: list[dict[str, Any]] = [
                {"version": 2}, {"pid": -5}, {"pid": 0}, {"pid": 2**40}, {"signal": 99},
                {"signal": 0}, {"expiration_time": 1e400},
            ]
            line = forged(targets["foreign"], **rng.choice(bad))
        elif roll < 0.68:
            line = forged(targets["foreign"], scope_id="y" * rng.randint(PIPE_BUF, 3 * PIPE_BUF))
        elif roll < 0.68 + 0.2:
            line = forged(targets[rng.choice(["foreign", "foreign2", "guardian", "init"])])
        else:
            line = forged(targets["supervisor"])
        line = line.replace(b"\n", b" ").replace(b"\r", b" ") or b"?"
        if not line.strip(b" "):
            line = b"?"
        out.append((line, expected_reason(line, targets)))
    return out


def expected_reason(line: bytes, targets: dict[str, int]) -> str:
    if len(line) > PIPE_BUF:
        return "oversized"
    result = parse_request(line)
    if isinstance(result, Rejected):
        return result.reason.value
    if result.pid == targets["supervisor"]:
        return "supervisor_pid"
    return "not_owned"  # foreign processes, the guardian and pid 1 are alive, never ours


class Faults:
    """Injects faults into ``rig``'s supervisor and records each in ``rig.faults``."""

    def __init__(self, rig: Rig) -> None:
        self.rig = rig

    async def destructive(self, kind: str) -> None:
        restart, group = self.rig.current()
        ranks = sorted(group)
        victim_rank = self.rig.rng.choice(ranks)
        pid = group[victim_rank][0]
        fault = Fault(kind, time.monotonic(), pid, {"restart": restart, "rank": victim_rank})
        self.rig.faults.append(fault)
        if kind == "crash":
            code = self.rig.rng.randint(1, 255)
            fault.detail["exit_code"] = code
            self.rig.command(pid, f"exit {code}")
        elif kind == "sigkill":
            self.rig.kill(pid, signal.SIGKILL)
        elif kind == "hang":
            self.rig.command(pid, f"hang {HANG_DEADLINE}")
        elif kind == "sigstop":
            self.rig.kill(pid, signal.SIGSTOP)
        elif kind == "sigstop+crash":
            other_rank = self.rig.rng.choice([r for r in ranks if r != victim_rank])
            other = group[other_rank][0]
            code = self.rig.rng.randint(1, 255)
            fault.detail.update(other=other, exit_code=code)
            self.rig.kill(pid, signal.SIGSTOP)
            self.rig.command(other, f"exit {code}")
        elif kind == "guardian-stop":
            code = self.rig.rng.randint(1, 255)
            fault.detail["exit_code"] = code
            await self.stop_guardian()
            self.rig.command(pid, f"exit {code}")
        try:
            await self.rig.wait_group(restart + 1)
        finally:
            if kind == "guardian-stop":
                self.rig.kill(self.rig.guardian, signal.SIGCONT)
        fault.observed = True

    async def stop_guardian(self) -> None:
        """SIGSTOP the guardian and fill its pipe (through /proc) with lines it ignores."""
        self.rig.kill(self.rig.guardian, signal.SIGSTOP)
        with anyio.fail_after(WAIT):  # kill() returns before the stop takes effect
            while proc_state(self.rig.guardian) != "T":
                await anyio.sleep(0.01)  # no event tells us
        fd = os.open(f"/proc/{self.rig.guardian}/fd/0", os.O_WRONLY | os.O_NONBLOCK)
        try:
            for chunk in (b"#\n" * 2048, b"#\n"):
                with contextlib.suppress(BlockingIOError):
                    while True:
                        os.write(fd, chunk)
        finally:
            os.close(fd)

    async def flood(self) -> None:
        restart, group = self.rig.current()
        rank = self.rig.rng.choice(sorted(group))
        pid = group[rank][0]
        self.rig.floods += 1
        tag = f"f{self.rig.floods}"
        count = self.rig.rng.randint(2000, 20000)
        fault = Fault("flood", time.monotonic(), pid,
                      {"restart": restart, "rank": rank, "tag": tag, "lines": count})
        self.rig.faults.append(fault)
        self.rig.command(pid, f"flood {tag} {count}")

        async def prober(session: aiohttp.ClientSession) -> None:
            while True:  # the supervisor must stay responsive while the output pours through
                await self.rig.probe(session, "GET", "/healthz")
                await anyio.sleep(0.05)  # pacing

        async with aiohttp.ClientSession() as session, anyio.create_task_group() as tg:
            tg.start_soon(prober, session)
            board = self.rig.board
            await board.wait_for(f"end of flood {tag}", lambda: tag in board.flooded)
            tg.cancel_scope.cancel()
        fault.observed = True

    async def frozen(self) -> None:
        """SIGSTOP the supervisor past the workers' deadline; SIGCONT; the group lives on."""
        restart, group = self.rig.current()
        fault = Fault("frozen", time.monotonic(), self.rig.pid,
                      {"restart": restart, "pids": sorted(p for p, _ in group.values())})
        self.rig.faults.append(fault)
        assert self.rig.proc is not None
        # no FIFO garbage meanwhile: lines over PIPE_BUF written into a FIFO that fills
        # during the freeze are torn and corrupt the workers' own requests (security.md)
        async with self.rig.fifo_quiet:
            await self.freeze(fault, restart)

    async def freeze(self, fault: Fault, restart: int) -> None:
        assert self.rig.proc is not None
        groups = self.rig.board.groups_started()
        self.rig.freeze_epoch += 1  # odd while frozen
        self.rig.proc.send_signal(signal.SIGSTOP)
        try:
            await anyio.sleep(FREEZE)  # the fault itself lasts this long
        finally:
            self.rig.proc.send_signal(signal.SIGCONT)
            self.rig.freeze_epoch += 1
        try:
            await self.sigusr1()  # every rank of the same group must still answer
        except TimeoutError:
            fault.problems.append(f"the group did not answer SIGUSR1 after a {FREEZE:g} s "
                                  "freeze (killed as hung?)")
            return
        if self.rig.board.restart != restart or self.rig.board.groups_started() != groups:
            fault.problems.append(f"the group restarted after a {FREEZE:g} s freeze")
            return
        fault.detail["confirmed"] = time.monotonic()  # the same clock as the events' "mono"
        fault.observed = True

    async def etcd_quorum(self) -> None:
        """SIGSTOP two of the three etcd members (no quorum) for longer than the lease
        TTL, then SIGCONT them: a healthy group rides the outage out (no restart, no worker
        exit) and answers a forwarded SIGUSR1 once etcd is back."""
        assert self.rig.etcd is not None
        restart, _group = self.rig.current()
        stopped = self.rig.rng.sample(self.rig.etcd.members, 2)
        fault = Fault("etcd-quorum", time.monotonic(), None,
                      {"restart": restart, "members": [m.name for m in stopped]})
        self.rig.faults.append(fault)
        exits = len(self.rig.board.events_named("worker_exited"))
        groups = self.rig.board.groups_started()
        for member in stopped:
            assert member.process is not None
            member.process.send_signal(signal.SIGSTOP)
        try:
            await anyio.sleep(ETCD_OUTAGE)  # the outage itself is the fault: it must last
        finally:
            for member in stopped:
                assert member.process is not None
                member.process.send_signal(signal.SIGCONT)
        # a member set that re-forms identically within one TTL after etcd returns is no
        # change: wait that out, then the same group must still be there and answer
        await anyio.sleep(ETCD_TTL + 1.0)  # the grace of the rendezvous leader
        try:
            await self.sigusr1()
        except TimeoutError:
            fault.problems.append("the group did not answer SIGUSR1 after the etcd outage")
            return
        if self.rig.board.restart != restart or self.rig.board.groups_started() != groups:
            fault.problems.append(f"the group restarted after a {ETCD_OUTAGE:g} s quorum loss")
        if len(self.rig.board.events_named("worker_exited")) != exits:
            fault.problems.append("a worker exited during the etcd outage")
        fault.observed = True

    async def diskfull(self) -> None:
        """Fill the log tmpfs while a worker floods; free it; the gap is marked."""
        assert self.rig.log_tmpfs is not None
        restart, group = self.rig.current()
        rank = self.rig.rng.choice(sorted(group))
        pid = group[rank][0]
        self.rig.floods += 1
        lost_tag, after_tag = f"f{self.rig.floods}", f"f{self.rig.floods}b"
        fault = Fault("diskfull", time.monotonic(), pid,
                      {"restart": restart, "rank": rank, "tag": after_tag})
        self.rig.faults.append(fault)
        [attempt_dir] = [e["dir"] for e in self.rig.board.events_named("group_started")
                         if pid in e["pids"].values()] or [None]
        failing = f"cannot write {attempt_dir}/{rank}/stdout.log"
        resumed = f"writing {attempt_dir}/{rank}/stdout.log again"
        seen, seen_resumed = self.rig.stderr_count(failing), self.rig.stderr_count(resumed)
        filler = self.rig.log_tmpfs / f"filler.{self.rig.floods}"
        fill_disk(filler)
        try:
            self.rig.command(pid, f"flood {lost_tag} 2000")
            await self.rig.board.wait_for(f"end of flood {lost_tag}",
                                      lambda: lost_tag in self.rig.board.flooded)
            await self.rig.wait_stderr(failing, seen + 1)  # this time, this rank's file
        finally:
            filler.unlink()
        self.rig.command(pid, f"flood {after_tag} 10")
        await self.rig.board.wait_for(f"end of flood {after_tag}",
                                  lambda: after_tag in self.rig.board.flooded)
        try:  # the marker is written, and this line logged, when writing works again
            await self.rig.wait_stderr(resumed, seen_resumed + 1)
        except TimeoutError:
            fault.problems.append(f"no '{resumed}' in the supervisor's log")
        if self.rig.board.restart != restart:
            fault.problems.append("the group restarted when the log disk was full")
        fault.observed = True

    async def grandchild(self) -> None:
        _, group = self.rig.current()
        rank = self.rig.rng.choice(sorted(group))
        pid = group[rank][0]
        gc = self.rig.board.gc[pid]
        fault = Fault("grandchild", time.monotonic(), gc, {"worker": pid, "rank": rank})
        self.rig.faults.append(fault)
        if not has_mark(gc, self.rig.mark):  # nothing but the harness may kill a grandchild
            fault.problems.append(f"grandchild {gc} of worker {pid} was gone already "
                                  f"(state {proc_state(gc)})")
            return
        self.rig.kill(gc, signal.SIGKILL)
        await self.rig.board.wait_for("new grandchild", lambda: self.rig.board.gc[pid] != gc)
        fault.observed = True

    async def sigusr1(self) -> None:
        restart, group = self.rig.current()
        before = {rank: self.rig.board.usr1[(restart, rank)] for rank in group}
        fault = Fault("sigusr1", time.monotonic(), None, {"restart": restart})
        self.rig.faults.append(fault)
        self.rig.n_sigusr1 += 1
        assert self.rig.proc is not None
        self.rig.proc.send_signal(signal.SIGUSR1)

        def all_got_it() -> bool:
            return all(self.rig.board.usr1[(restart, r)] > before[r] for r in group)

        await self.rig.board.wait_for("SIGUSR1 forwarded", all_got_it)
        fault.observed = True

    async def sighup(self) -> None:
        self.rig.n_sighup += 1
        fault = Fault("sighup", time.monotonic(), None, {"n": self.rig.n_sighup})
        self.rig.faults.append(fault)
        events = self.rig.root / "logs" / "chaos" / "events.jsonl"
        with contextlib.suppress(FileNotFoundError):
            os.rename(events, events.with_name(f"events.jsonl.{self.rig.n_sighup}"))
        assert self.rig.proc is not None
        self.rig.proc.send_signal(signal.SIGHUP)
        n = self.rig.n_sighup
        await self.rig.board.wait_for(
            "logs reopened", lambda: len(self.rig.board.events_named("logs_reopened")) >= n
        )
        fault.observed = True

    async def fifo(self) -> None:
        if self.rig.board.fifo is None:
            return
        targets = {"foreign": min(self.rig.foreign), "foreign2": max(self.rig.foreign),
                   "supervisor": self.rig.pid, "guardian": self.rig.guardian, "init": 1}
        lines = fifo_lines(self.rig.rng, targets)
        fault = Fault("fifo", time.monotonic(), None, {"lines": len(lines)})
        self.rig.faults.append(fault)
        async with self.rig.fifo_quiet:
            await self.write_fifo(lines)
        fault.observed = True

    async def write_fifo(self, lines: list[tuple[bytes, str]]) -> None:
        assert self.rig.board.fifo is not None
        fd = os.open(self.rig.board.fifo, os.O_WRONLY | os.O_NONBLOCK)
        try:
            for line, reason in lines:
                data = line + b"\n"
                while data:
                    try:
                        data = data[os.write(fd, data):]
                    except BlockingIOError:
                        await anyio.sleep(0.01)  # pacing: the FIFO is full
                self.rig.fifo_expected[reason] += 1
        finally:
            os.close(fd)

    async def http_storm(self) -> None:
        n = self.rig.rng.randint(50, 250)
        fault = Fault("http", time.monotonic(), None, {"requests": n})
        self.rig.faults.append(fault)
        paths = ["/healthz", "/readyz", "/status", "/metrics", "/openapi.json"]
        connector = aiohttp.TCPConnector(limit=self.rig.rng.randint(1, 40))
        async with aiohttp.ClientSession(connector=connector) as session, \
                anyio.create_task_group() as tg:
            for _ in range(n):
                roll = self.rig.rng.random()
                if roll < 0.6:
                    method, path = self.rig.rng.choice(["GET", "HEAD"]), self.rig.rng.choice(paths)
                elif roll < 0.7:
                    method, path = "GET", self.rig.rng.choice(paths) + "?x=" + "y" * 300
                elif roll < 0.85:
                    method = self.rig.rng.choice(["GET", "HEAD"])
                    path = "/" + "/".join(
                        "".join(self.rig.rng.choice("abcxyz019-_") for _ in range(5))
                        for _ in range(self.rig.rng.randint(1, 4))
                    )
                else:
                    method = self.rig.rng.choice(["POST", "PUT", "DELETE", "PATCH"])
                    path = self.rig.rng.choice(paths)
                tg.start_soon(self.rig.probe, session, method, path)
        for _ in range(self.rig.rng.randint(0, 5)):
            await self.raw_garbage()
        fault.observed = True

    async def raw_garbage(self) -> None:
        junk = bytes(self.rig.rng.randrange(1, 256) for _ in range(self.rig.rng.randint(1, 200)))
        try:
            # junk of only CR and LF is blank lines before a request (RFC 9112 2.2): the
            # server waits for the request and closes the connection at its deadline
            with anyio.fail_after(REQUEST_DEADLINE + 5):
                async with await anyio.connect_tcp("127.0.0.1", self.rig.port) as stream:
                    await stream.send(junk + b"\r\n\r\n")
                    reply = b""
                    with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError,
                                             ConnectionResetError):
                        while b"\r\n" not in reply:
                            reply += await stream.receive()
        except (OSError, TimeoutError) as exc:
            self.rig.violate(f"raw garbage request: {type(exc).__name__}: {exc}")
            return
        if reply.startswith(b"HTTP/1.") and reply[9:10] == b"5":
            self.rig.violate(f"raw garbage request answered {reply[:20]!r}")

    async def background(self, action: Callable[[], Awaitable[None]], low: float,
                         high: float) -> None:
        while not self.rig.stop_injecting.is_set():
            with anyio.move_on_after(self.rig.rng.uniform(low, high)):
                await self.rig.stop_injecting.wait()  # pacing between injections
            if self.rig.stop_injecting.is_set():
                return
            await action()

    async def main_loop(self, until: float) -> None:
        kinds = {"crash": 3, "sigkill": 2, "hang": 2, "sigstop": 1, "sigstop+crash": 1,
                 "guardian-stop": 1,
                 "flood": 2, "grandchild": 2, "sigusr1": 2, "frozen": 1}
        if self.rig.log_tmpfs is not None:
            kinds["diskfull"] = 1
        if self.rig.etcd is not None:
            kinds["etcd-quorum"] = 1
            del kinds["frozen"]  # see the note at ETCD_OUTAGE
        if self.rig.args.kinds:
            wanted = set(self.rig.args.kinds.split(","))
            kinds = {k: w for k, w in kinds.items() if k in wanted} or kinds
        names, weights = list(kinds), list(kinds.values())
        while time.monotonic() < until:
            restart = self.rig.board.restart
            await self.rig.wait_group(restart)
            kind = self.rig.rng.choices(names, weights)[0]
            log(f"{kind} (restart {restart})")
            if kind in DESTRUCTIVE:
                await self.destructive(kind)
            else:
                await {"flood": self.flood, "grandchild": self.grandchild,
                       "sigusr1": self.sigusr1, "frozen": self.frozen,
                       "diskfull": self.diskfull, "etcd-quorum": self.etcd_quorum}[kind]()
            await anyio.sleep(self.rig.rng.uniform(0.05, 0.4))  # pacing

    async def warm_up(self) -> None:
        """One of everything, so lazily made resources exist before the baseline."""
        await self.destructive("crash")
        await self.http_storm()
        await self.fifo()
        await self.flood()
        await self.sighup()
        await self.sigusr1()
        if self.rig.etcd is None:  # see the note at ETCD_OUTAGE
            await self.frozen()
        if self.rig.log_tmpfs is not None:
            await self.diskfull()
        await self.rig.settle()
        self.rig.usage_start = Usage.of(self.rig.pid, self.rig.worker_pids())
        log(f"baseline: {self.rig.usage_start}")
