"""A full disk, for real (a 1 MiB tmpfs filled up, then freed): worker output and events
that cannot be written are counted and marked, never lost silently (issue 18, item 8)."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path
from typing import Any

import anyio

from supervisor.core.statusview import MAX_MESSAGE_CHARS
from supervisor.events import MAX_PENDING, EventLog
from supervisor.health.metrics import Metrics
from supervisor.workers.output import LogFile, OutputLoss
from tests.support.daemon import supervisor
from tests.support.paths import WORKERS
from tests.support.tmpfs import fill, small_tmpfs

MARKER = re.compile(rb"\[elastic-supervisor: (\d+) bytes of output lost here: ([^\]]+)\]\n")


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ------------------------------------------------------------------ log files


def test_output_lost_on_a_full_disk_is_counted_and_marked(tmp_path: Path) -> None:
    told: list[tuple[str, dict[str, Any]]] = []
    loss = OutputLoss(listeners=[lambda event, fields: told.append((event, fields))])
    with small_tmpfs(tmp_path / "disk") as disk:
        log = LogFile(disk / "stdout.log", loss)
        log.write(b"before\n")
        filler = fill(disk)
        sent = b"before\n"
        for i in range(50):
            chunk = f"line {i} ".encode() * 100 + b"\n"
            log.write(chunk)
            sent += chunk
        filler.unlink()  # space returns
        log.write(b"after\n")
        log.close()
        data = (disk / "stdout.log").read_bytes()
    [marker] = MARKER.findall(data)
    assert int(marker[0]) == loss.lost_bytes > 0
    assert marker[1] == b"No space left on device"
    # the file holds what the worker wrote up to the loss, then the marker, then the rest:
    # what reached the file and what was counted lost add up to what the worker wrote
    found = MARKER.search(data)
    assert found is not None and data[found.end():] == b"after\n"
    head = data[: found.start()].removesuffix(b"\n")  # the marker starts a line of its own
    assert sent.startswith(head)
    assert len(sent) - (len(head) + loss.lost_bytes) in (0, 1)  # 1: head's own newline
    assert loss.write_errors >= 1
    assert [event for event, _ in told] == ["output_write_failed", "output_lost"]
    assert told[1][1] == {"file": str(disk / "stdout.log"), "bytes": loss.lost_bytes,
                          "resumed": True}


def test_output_still_lost_at_close_is_reported(tmp_path: Path) -> None:
    told: list[tuple[str, dict[str, Any]]] = []
    loss = OutputLoss(listeners=[lambda event, fields: told.append((event, fields))])
    with small_tmpfs(tmp_path / "disk") as disk:
        log = LogFile(disk / "stdout.log", loss)
        fill(disk)
        log.write(b"x" * 100_000)
        log.close()
    assert told[-1] == ("output_lost", {"file": str(disk / "stdout.log"),
                                        "bytes": loss.lost_bytes, "resumed": False})
    assert loss.lost_bytes > 0


def test_metrics_export_lost_output() -> None:
    metrics = Metrics()
    loss = OutputLoss(lost_bytes=1234, write_errors=3)
    metrics.watch_output(loss)
    text = metrics.render().decode()
    assert "elastic_supervisor_output_lost_bytes_total 1234.0" in text
    assert "elastic_supervisor_output_write_errors_total 3.0" in text


# ------------------------------------------------------------------ the event log


def test_events_on_a_full_disk_are_kept_then_written_with_the_gap_marked(
    tmp_path: Path,
) -> None:
    with small_tmpfs(tmp_path / "disk") as disk:
        path = disk / "events.jsonl"
        log = EventLog(path, "run")
        log.emit("before")
        filler = fill(disk)
        emitted = MAX_PENDING + 300
        for i in range(emitted):
            log.emit("during", i=i)
        assert log.dropped > 0 and log.pending > 0
        summary = log.loss_summary()
        assert summary is not None and "No space left on device" in summary
        filler.unlink()
        log.emit("after")
        assert (log.pending, log.loss_summary()) == (0, f"event log {path}: {log.dropped} "
                                                        "event(s) lost, 0 not written")
        log.close()
        got = records(path)
    kinds = [r["event"] for r in got]
    assert kinds[0] == "before" and kinds[-1] == "after"
    [gap] = [r for r in got if r["event"] == "events_dropped"]
    assert gap["count"] == log.dropped and gap["reason"] == "No space left on device"
    during = [r["i"] for r in got if r["event"] == "during"]
    # in order, none twice; exactly the dropped ones are missing, right where the gap is
    assert during == sorted(set(during)) and len(during) + log.dropped == emitted
    assert during[-1] == during[0] + len(during) - 1  # the kept ones are contiguous
    assert kinds.index("events_dropped") == kinds.index("during") + len(during)


async def test_pending_events_are_flushed_when_space_returns_without_a_new_event(
    tmp_path: Path,
) -> None:
    with small_tmpfs(tmp_path / "disk") as disk:
        path = disk / "events.jsonl"
        log = EventLog(path, "run")
        async with anyio.create_task_group() as tg:
            await tg.start(log.retry_pending, 0.05)
            filler = fill(disk)
            for i in range(200):
                log.emit("during", i=i)
            assert log.pending > 0
            filler.unlink()
            with anyio.fail_after(10):
                while log.pending:  # the retry task's work; nothing announces it
                    await anyio.sleep(0.02)
            tg.cancel_scope.cancel()
        log.close()
        got = records(path)
    assert [r["i"] for r in got] == list(range(200)) and log.dropped == 0


def test_an_event_log_that_cannot_be_created_keeps_events_until_it_can(
    tmp_path: Path,
) -> None:
    with small_tmpfs(tmp_path / "disk", inodes=2) as disk:  # the root, and one more
        blocker = disk / "blocker"
        blocker.write_text("")  # the last inode: events.jsonl cannot be created
        log = EventLog(disk / "events.jsonl", "run")
        log.emit("first")
        assert log.pending == 1
        blocker.unlink()
        log.emit("second")
        log.close()
        assert [r["event"] for r in records(disk / "events.jsonl")] == ["first", "second"]


def test_metrics_export_dropped_and_pending_events(tmp_path: Path) -> None:
    metrics = Metrics()
    log = EventLog(None, "run")
    metrics.watch_event_log(log)
    text = metrics.render().decode()
    assert "elastic_supervisor_events_dropped_total 0.0" in text
    assert "elastic_supervisor_events_pending 0.0" in text


# ------------------------------------------------------------------ the real daemon

TICKER = (WORKERS / "ticker.py").read_text()


async def test_daemon_marks_worker_output_lost_on_a_full_log_disk(tmp_path: Path) -> None:
    """The log dir on a 1 MiB tmpfs: filled while the worker prints, then freed. The
    rank's stdout.log says how many bytes are missing and where; the job goes on."""
    script = tmp_path / "ticker.py"
    script.write_text(TICKER)
    with small_tmpfs(tmp_path / "disk", size="4m") as disk:
        args = ["--health-port", "0", "--redirects", "3", "--log-dir", str(disk),
                "--rdzv-id", "full", str(script)]
        async with supervisor(args) as sup:
            stdout_log = disk / "full" / "attempt_0" / "0" / "stdout.log"
            with anyio.fail_after(15):
                while not stdout_log.exists() or b"ready" not in stdout_log.read_bytes():
                    await anyio.sleep(0.02)  # the file is the only sign; it has no event
            filler = fill(disk)
            await sup.err.expect(r"cannot write \S+stdout.log: No space left on device")
            filler.unlink()
            resumed = await sup.err.expect(r"writing \S+stdout.log again: (\d+) bytes")
            sup.signal(signal.SIGTERM)
            assert await sup.wait() == 143
        data = stdout_log.read_bytes()
        kinds = [r["event"] for r in records(disk / "full" / "events.jsonl")]
    [marker] = MARKER.findall(data)
    assert int(marker[0]) == int(resumed.group(1)) > 0
    assert "group_started" in kinds and "group_stopped" in kinds  # every line is JSON


def test_huge_string_fields_are_capped_in_the_event_log(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "events.jsonl", "run")
    log.emit("group_stopping", root_cause="local rank 0 exited: " + "x" * (1 << 20))
    log.close()
    [record] = records(tmp_path / "events.jsonl")
    assert len(record["root_cause"]) <= MAX_MESSAGE_CHARS
    assert record["root_cause"].endswith("more characters cut]")
