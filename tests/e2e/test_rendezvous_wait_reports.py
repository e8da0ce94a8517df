"""Long rendezvous waits say what they wait for: a line every 30 s (here shorter), the
same in ``/status`` and ``elastic-supervisor status``; a name that does not resolve is a
WARNING each time (supervisor.rendezvous.etcd.waitreport)."""

from __future__ import annotations

import json
import logging
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import anyio
import pytest

from supervisor.rendezvous.base import RendezvousError
from supervisor.rendezvous.etcd.backend import EtcdRendezvous, open_etcd_rendezvous
from supervisor.rendezvous.etcd.config import EtcdRendezvousConfig
from supervisor.rendezvous.etcd.waitreport import WaitClock, WaitProgress, unresolved
from tests.support.daemon import supervisor
from tests.support.etcd import EtcdMember
from tests.support.ports import free_port


def test_the_clock_is_due_every_interval_from_the_start() -> None:
    clock = WaitClock(100.0, 0.0, every=30.0)
    assert not clock.due(129.9) and clock.due(130.0)
    clock.reported(131.0)
    assert clock.next_due == 160.0 and not clock.due(159.0)
    assert WaitClock(100.0, 0.0, next_due_now=True).due(100.0)


def test_the_line_says_what_how_many_and_since_when() -> None:
    wait = WaitProgress("nodes to join round 0", 0.0, 61.0, joined=1, needed=2, max_nodes=4)
    assert wait.line().startswith("waiting 61s (since ")
    assert wait.line().endswith("for nodes to join round 0: 1 of 2 node(s) joined (max 4)")
    assert wait.level() == logging.INFO


def test_an_unresolved_name_is_a_warning() -> None:
    cause = ("http://nosuch.invalid:2379: ClientConnectorDNSError: Cannot connect to host "
             "nosuch.invalid:2379 ssl:default [Name or service not known]")
    assert unresolved(cause)
    assert WaitProgress("etcd", 0.0, 1.0, cause=cause).level() == logging.WARNING
    assert not unresolved("http://127.0.0.1:1: ClientConnectorError: Connection refused")


# ----------------------------------------------------------------------------- real etcd


def config(endpoints: tuple[str, ...], **overrides: Any) -> EtcdRendezvousConfig:
    settings: dict[str, Any] = dict(run_id="waits", min_nodes=2, max_nodes=2, node_id="n0",
                                    join_timeout=20, last_call_timeout=0.1, lease_ttl=2,
                                    request_timeout=2, wait_report_every=0.2)
    settings.update(overrides)
    return EtcdRendezvousConfig(endpoints=endpoints, **settings)


@pytest.mark.etcd
async def test_waiting_for_a_second_node_reports_and_shows_in_status(
        server: EtcdMember, caplog: pytest.LogCaptureFixture) -> None:
    seen: list[dict[str, Any]] = []
    got_two = anyio.Event()  # the first is published at once, the second logged too

    def on_event(kind: str, **fields: Any) -> None:
        if kind == "rendezvous_waiting":
            seen.append(fields)
            if len(seen) == 2:
                got_two.set()

    async with open_etcd_rendezvous(config((server.endpoint,))) as rdzv:
        rdzv.on_event = on_event
        with caplog.at_level(logging.INFO):
            async with anyio.create_task_group() as tg:
                tg.start_soon(rdzv.next_round, 1)
                with anyio.fail_after(10):
                    await got_two.wait()
                status = rdzv.outage_status()["waiting"]
                tg.cancel_scope.cancel()
        assert rdzv.outage_status()["waiting"] is None  # the wait is over
    assert seen[1]["joined"] == 1 and seen[1]["needed"] == 2 and seen[1]["waited"] > 0
    assert status["what"] == "nodes to join round 0" and status["joined"] == 1
    assert "for nodes to join round 0: 1 of 2 node(s) joined" in caplog.text


async def test_a_name_that_does_not_resolve_warns_each_time(
        caplog: pytest.LogCaptureFixture) -> None:
    cfg = config(("http://nosuch-host.invalid:2379",), join_timeout=3, lease_ttl=1,
                 request_timeout=0.5)
    rdzv = EtcdRendezvous(cfg)
    with caplog.at_level(logging.INFO), anyio.fail_after(20):
        with pytest.raises(RendezvousError, match=r"nosuch-host\.invalid"):
            await rdzv.connect()
        await rdzv.aclose()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING
                and "to answer" in r.getMessage()]
    assert len(warnings) >= 2, caplog.text
    assert all("Name or service not known" in r.getMessage() or "DNS" in r.getMessage()
               for r in warnings)


async def test_an_etcd_that_does_not_answer_is_reported_at_the_first_failed_pass(
        caplog: pytest.LogCaptureFixture) -> None:
    """Not a whole bounded try (one lease TTL, 60 s here) later: a node started before
    its etcd says so at once."""
    cfg = config((f"http://127.0.0.1:{free_port()}",), join_timeout=120, lease_ttl=60)
    rdzv = EtcdRendezvous(cfg)
    reported = anyio.Event()

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "to answer" in record.getMessage():
                reported.set()

    seen = Seen()
    logging.getLogger("supervisor.rendezvous.etcd").addHandler(seen)
    try:
        with caplog.at_level(logging.INFO):
            async with anyio.create_task_group() as tg:
                tg.start_soon(rdzv.connect)
                with anyio.fail_after(30):
                    await reported.wait()
                tg.cancel_scope.cancel()
    finally:
        logging.getLogger("supervisor.rendezvous.etcd").removeHandler(seen)
        await rdzv.aclose()
    record = next(r for r in caplog.records if "to answer" in r.getMessage())
    line = record.getMessage()
    assert record.levelno == logging.WARNING, line
    # the endpoint, the error, and how long it keeps trying
    assert f"for etcd at {cfg.endpoints[0]} to answer" in line, line
    assert "connection refused" in line, line  # the kernel's words, not aiohttp's
    assert re.search(r"; retrying for 1[12]\ds more \(join_timeout 120s: --rdzv-conf "
                     r"join_timeout=SECONDS\)$", line), line


async def test_an_etcd_that_does_not_answer_is_reported_again_every_interval(
        caplog: pytest.LogCaptureFixture) -> None:
    """Every ``wait_report_every`` (30 s; 0.2 s here), checked at the end of each bounded
    try (one lease TTL: 1 s here), with the time left shrinking."""
    cfg = config((f"http://127.0.0.1:{free_port()}",), join_timeout=120, lease_ttl=1)
    rdzv = EtcdRendezvous(cfg)
    lines: list[str] = []
    two = anyio.Event()

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "to answer" in record.getMessage() and record.levelno == logging.WARNING:
                lines.append(record.getMessage())
                if len(lines) == 2:
                    two.set()

    seen = Seen()
    logging.getLogger("supervisor.rendezvous.etcd").addHandler(seen)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(rdzv.connect)
            with anyio.fail_after(30):
                await two.wait()
            tg.cancel_scope.cancel()
    finally:
        logging.getLogger("supervisor.rendezvous.etcd").removeHandler(seen)
        await rdzv.aclose()
    waited = [float(re.search(r"^waiting (\d+)s", line).group(1))  # type: ignore[union-attr]
              for line in lines]
    left = [float(re.search(r"retrying for (\d+)s more", line).group(1))  # type: ignore[union-attr]
            for line in lines]
    assert waited[0] <= waited[1] and left[0] >= left[1], lines


@pytest.mark.etcd
async def test_status_command_during_the_wait_says_what_it_waits_for(
        server: EtcdMember, tmp_path: Path) -> None:
    async with supervisor(["--nnodes=2", "--rdzv-backend=etcd",
                           f"--rdzv-endpoint={server.endpoint}", "--rdzv-id=waitjob",
                           "--health-host=127.0.0.1", "--health-port=0", "--log-level=debug",
                           f"--log-dir={tmp_path}", "--no-python", "/bin/true"]) as sup:
        # the first wait is published at once (a debug line), later ones every 30 s
        await sup.err.expect("etcd rendezvous waitjob: waiting", timeout=20)
        if "health server listening" not in sup.err.text():  # either line may come first
            await sup.err.expect("health server listening", timeout=20)
        port = re.search(r"health server listening on http://[\d.]+:(\d+)", sup.err.text())
        assert port is not None
        url = f"http://127.0.0.1:{port.group(1)}"
        doc = json.loads(await anyio.to_thread.run_sync(_get, url + "/status"))
        shown = await anyio.to_thread.run_sync(_status_command, url)
    waiting = doc["rendezvous"]["etcd"]["waiting"]
    assert (waiting["what"], waiting["joined"], waiting["needed"]) == (
        "nodes to join round 0", 1, 2)
    assert "not in a round yet" in shown and "node 0 of 0" not in shown
    assert "waiting     for " in shown


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as resp:
        body: bytes = resp.read()
    return body


def _status_command(url: str) -> str:
    return subprocess.run([sys.executable, "-m", "supervisor", "status", "--url", url],
                          capture_output=True, text=True, timeout=30, check=True).stdout


@pytest.mark.parametrize("backend", ["etcd", "c10d"])
async def test_an_endpoint_that_does_not_answer_is_a_warning_at_once(
        tmp_path: Path, backend: str) -> None:
    """The issue's case: ``--rdzv-endpoint 127.0.0.1:1`` (c10d: a client, ``is_host=0``).
    A WARNING names the endpoint, the error and how long the node keeps trying (the
    default join_timeout, 600 s), at the first failure; the node keeps waiting."""
    conf = ["--rdzv-conf", "is_host=0"] if backend == "c10d" else []
    async with supervisor(["--nnodes=2", f"--rdzv-backend={backend}",
                           "--rdzv-endpoint=127.0.0.1:1", *conf, "--health-port=0",
                           f"--log-dir={tmp_path}", "--no-python", "/bin/true"]) as sup:
        line = await sup.err.expect(r"WARNING .*to answer.*", timeout=30)
        assert sup.process.returncode is None  # still waiting
        sup.signal(signal.SIGTERM)
        assert await sup.wait(timeout=15) == 128 + signal.SIGTERM
    text = line.group(0)
    assert "http://127.0.0.1:1" in text and "connection refused" in text, text
    # c10d users never set up an etcd: the line speaks of the rendezvous host
    assert ("etcd at" in text) == (backend == "etcd"), text
    assert ("the rendezvous host 127.0.0.1:1 to answer" in text) == (backend == "c10d"), text
    assert re.search(r"retrying for (599|600)s more \(join_timeout 600s", text), text
