"""Chaos run: random faults against a real supervisor for a bounded time, then invariants.

    python benchmarks/chaos.py [--seconds 60] [--seed N] [--workers 4] [--json FILE] [--keep]

One real daemon (``python -m supervisor run``) supervises WORKERS chaos workers with a
huge ``--max-restarts``, ``--health-port 0``, the deadline FIFO and ``--tee 3`` (output
through the supervisor's pipes). Every worker keeps a grandchild (``sleep``; odd ranks put
it in a session of its own, as a daemonising library would) and renews a ``loop`` deadline
every 0.2 s. For SECONDS the harness injects, at random:

- destructive faults, one at a time (each is waited out: the next group must come up):
  ``crash`` (a random non-zero exit code), ``sigkill`` (SIGKILL a worker), ``hang`` (a
  worker blocks inside ``supervisor.worker.expires(0.3)``), ``sigstop`` (SIGSTOP a worker:
  its ``loop`` deadline expires), ``sigstop+crash`` (SIGSTOP one worker, crash another: the
  group stop must SIGKILL a stopped process), ``guardian-stop`` (SIGSTOP the guardian and
  fill its pipe, then crash a worker: the restart must not block on the pipe);
- ``flood`` (a worker writes thousands of lines at once), ``grandchild`` (SIGKILL a
  worker's grandchild), ``sigusr1`` (to the supervisor: forwarded to every worker);
- ``frozen`` (the supervisor itself is SIGSTOPped for longer than the workers' ``loop``
  deadline, then SIGCONTed: no worker may be killed as hung, the same group answers a
  forwarded SIGUSR1 afterwards);
- ``diskfull`` (only with ``--disk-full``, as root: the log directory is a tmpfs; it is
  filled while a worker floods, then freed: the rank's ``stdout.log`` must carry the
  supervisor's "bytes of output lost" marker followed by what the worker wrote after);
- ``etcd-quorum`` (only with ``--etcd``: the supervisor runs the etcd backend against a
  3-member cluster the harness starts; two members are SIGSTOPped, so no quorum, for
  longer than the lease TTL, then continued: the healthy group must ride the outage out,
  with no worker exit, no restart and no re-formed group, and answer a forwarded SIGUSR1
  afterwards). ``frozen`` is left out with ``--etcd``: a supervisor frozen past its lease
  TTL is a node that left, and the job rightly re-forms;
- in the background, all the time: ``fifo`` (garbage, oversized lines and forged requests
  naming foreign processes, the supervisor, its guardian and pid 1 written to the deadline
  FIFO), ``http`` (probe storms: every path and method, unknown paths, raw garbage) and
  ``sighup`` (the event log is renamed first, as logrotate does).

Foreign processes (started by the harness, not under the supervisor) log every signal
they get. At the end the harness checks, and counts a violation for each failure:

- the supervisor is alive, answers ``/healthz``, and the group is running again;
- every fault is accounted for: the victim's ``worker_exited`` event (exit code or
  signal) and the root cause in ``events.jsonl``; restarts and failures by kind, FIFO
  rejections by reason, HTTP requests by path and code, forwarded signals and log
  reopens in ``/metrics`` and the event log;
- restarts never exceed the budget (``/status`` agrees with the event log);
- no zombie child of the supervisor; after SIGTERM, no process carrying this run's
  marker (``CHAOS_RUN=<token>`` in its environment, inherited by every worker and
  descendant) is left;
- foreign processes alive, never stopped, never signalled;
- the supervisor's fds and threads back to within a small bound of the start, and RSS too
  (connections to etcd members bounded apart: streams and pooled connections move between
  members with the outages), and no connection its peer closed left open;
- after a ``frozen`` fault, no ``deadline_expired`` for the frozen group's ``loop`` scope
  and a logged stall; after a ``diskfull`` fault, the lost-output marker in the rank's log;
- every attempt's log directory exists with every rank's files.

HTTP latencies of requests in flight during a freeze are left out of the figures.
Prints a table (faults by kind: injected, survived, violations) and exits 1 on any
violation. Progress goes to stderr. Nothing here is used by the library.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
import traceback
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

import anyio
import anyio.to_thread

from benchmarks.chaos_checks import Checks
from benchmarks.chaos_faults import Faults
from benchmarks.chaos_rig import (
    Report,
    Rig,
    leaves,
    log,
)


class Chaos:
    """A chaos run: the rig, the faults injected into it and the checks after them."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.rig = Rig(args)
        self.faults = Faults(self.rig)
        self.checks = Checks(self.rig)

    async def run(self) -> Report:
        rig, faults, checks = self.rig, self.faults, self.checks
        t0 = time.monotonic()
        signalled = 0
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(rig.control)
                tg.start_soon(rig.tail.run)
                await rig.start_foreign()
                await rig.start()
                await rig.wait_health()
                await rig.wait_group(0)
                rig.guardian = await rig.find_guardian()
                await faults.warm_up()
                until = time.monotonic() + rig.args.seconds
                log(f"injecting faults for {rig.args.seconds:g} s (seed {rig.args.seed})")
                async with anyio.create_task_group() as inject:
                    inject.start_soon(faults.background, faults.fifo, 0.2, 1.2)
                    inject.start_soon(faults.background, faults.http_storm, 0.5, 2.5)
                    inject.start_soon(faults.background, faults.sighup, 2.0, 5.0)
                    try:
                        await faults.main_loop(until)
                    finally:
                        rig.stop_injecting.set()
                log("faults stopped; checking invariants")
                await checks.final_checks()
                await rig.stop_supervisor()
                rig.tail.poll()
                await checks.check_orphans()
                checks.check_events()
                tg.cancel_scope.cancel()
        except* Exception as group:
            for exc in leaves(group):
                traceback.print_exception(exc, file=sys.stderr)
                rig.violate(f"run aborted: {type(exc).__name__}: {exc}")
        finally:
            with anyio.CancelScope(shield=True):
                signalled = checks.check_foreign()
                await rig.cleanup()
            rig.tail.close()
        return self.report(time.monotonic() - t0, signalled)

    def report(self, wall: float, signalled: int) -> Report:
        rig = self.rig
        table: dict[str, dict[str, int]] = {}
        for f in rig.faults:
            row = table.setdefault(f.kind, {"injected": 0, "survived": 0, "violations": 0})
            row["injected"] += 1
            row["survived"] += int(f.observed and not f.problems)
            row["violations"] += len(f.problems)
        lat = sorted(rig.http_latency) or [math.nan]
        return Report(
            seed=rig.args.seed, seconds=rig.args.seconds, workers=rig.args.workers,
            faults=table, violations=rig.violations,
            restarts=len(rig.board.events_named("restart_scheduled")),
            attempts=len(rig.board.events_named("group_started")),
            usage_start=asdict(rig.usage_start) if rig.usage_start else {},
            usage_end=asdict(rig.usage_end) if rig.usage_end else {},
            http_requests=sum(rig.http_sent.values()),
            http_max_latency_ms=lat[-1] * 1000,
            http_p99_latency_ms=lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1000,
            http_timeouts_across_freezes=rig.http_timeouts_across_freezes,
            fifo_lines=sum(rig.fifo_expected.values()),
            orphans=len(rig.orphans), foreign_signalled=signalled, wall=wall,
        )

def render(report: Report) -> str:
    lines = [
        f"chaos run: {report.seconds:g} s of faults (seed {report.seed}), {report.workers} "
        f"workers, {report.wall:.0f} s in all",
        "",
        "| fault | injected | survived | violations |",
        "|---|---|---|---|",
    ]
    for kind, row in sorted(report.faults.items()):
        lines.append(f"| {kind} | {row['injected']} | {row['survived']} | {row['violations']} |")
    total = {k: sum(r[k] for r in report.faults.values())
             for k in ("injected", "survived", "violations")}
    lines.append(f"| **all** | {total['injected']} | {total['survived']} | "
                 f"{len(report.violations)} |")
    s, e = report.usage_start, report.usage_end
    lines += [
        "",
        f"restarts: {report.restarts} ({report.attempts} attempts); HTTP requests: "
        f"{report.http_requests} (p99 {report.http_p99_latency_ms:.1f} ms, max "
        f"{report.http_max_latency_ms:.1f} ms; timed out across a freeze: "
        f"{report.http_timeouts_across_freezes}); FIFO lines: {report.fifo_lines}",
        f"supervisor fds {s.get('fds')} -> {e.get('fds')}, threads {s.get('threads')} -> "
        f"{e.get('threads')}, RSS {s.get('rss_mb', 0):.1f} -> {e.get('rss_mb', 0):.1f} MB, "
        f"children {s.get('children')} -> {e.get('children')}",
        f"orphans after stop: {report.orphans}; foreign processes signalled: "
        f"{report.foreign_signalled}",
    ]
    if report.violations:
        lines += ["", "violations:"] + [f"- {v}" for v in report.violations]
    else:
        lines += ["", "violations: none"]
    return "\n".join(lines)


def main(argv: Iterable[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="how long to inject faults")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--max-restarts", type=int, default=100000)
    p.add_argument("--json", default=None, help="write the report as JSON here")
    p.add_argument("--keep", action="store_true", help="keep the run directory")
    p.add_argument("--kinds", default="",
                   help="only these main-loop faults, comma-separated (e.g. frozen,diskfull)")
    p.add_argument("--disk-full", action="store_true",
                   help="put the logs on a tmpfs and inject 'diskfull' faults (needs root)")
    p.add_argument("--etcd", action="store_true",
                   help="run the etcd backend against a 3-member cluster and inject "
                        "'etcd-quorum' faults (needs Debian's etcd-server)")
    args = p.parse_args(list(argv) if argv is not None else None)
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(10**6)
    chaos = Chaos(args)
    try:
        report = anyio.run(chaos.run)
    finally:
        if args.keep:
            log(f"run directory kept: {chaos.rig.root}")
        else:
            shutil.rmtree(chaos.rig.root, ignore_errors=True)
    print(render(report))
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(report), indent=2))
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
