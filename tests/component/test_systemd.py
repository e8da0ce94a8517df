"""systemd integration: unit files, sd_notify messages, watchdog pings, log format.

systemd is not PID 1 here, so the tests play the service manager themselves: they bind
an AF_UNIX datagram socket, point NOTIFY_SOCKET at it and read what the Notifier sends,
with SO_PASSCRED on so the kernel tells us the sender's pid (what NotifyAccess=main
checks). Every wait is a socket read bounded by ``anyio.fail_after``.

End-to-end checks against the real daemon belong in the CLI tests once
``elastic-supervisor run`` exists (see docs/deploy.md, "Testing under systemd"):
- READY=1 arrives only after every worker has been spawned (the pids in /status are
  alive), preceded by STATUS lines for rendezvous/starting, and from the main pid;
- no READY=1 (and exit code 2) on a bad config;
- WATCHDOG=1 every WATCHDOG_USEC/2 from the start, also before READY=1;
- SIGTERM: STOPPING=1 comes before the workers get SIGTERM, EXTEND_TIMEOUT_USEC while
  a long grace runs, exit code 143, no worker left alive;
- workers' environments carry none of NOTIFY_SOCKET, WATCHDOG_USEC, WATCHDOG_PID;
- SIGHUP reopens the log file (rename it, send HUP, the next line is in a new file).
"""

from __future__ import annotations

import io
import itertools
import json
import logging
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import msgspec
import pytest

from supervisor import config, logsetup
from supervisor.core.statusview import FailureView, StatusView, WorkerView
from supervisor.systemd import (
    LagProbe,
    Notifier,
    StatusReporter,
    WatchdogSettings,
    extending_timeout,
    format_status,
    parse_notify_socket,
    parse_watchdog,
    run_watchdog_pings,
)
from tests.support.paths import REPO

UNITS = REPO / "systemd"
INSTALLED_BINARY = "/opt/elastic-supervisor/venv/bin/elastic-supervisor"
DEFAULT_SHUTDOWN_TIMEOUT = 30.0  # the daemon's default shutdown_timeout (DESIGN.md)
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_systemd_analyze = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed (apt-get install systemd)"
)

# ============================================================================ unit files


def stage_unit(name: str, directory: Path) -> Path:
    """Copy a unit into ``directory`` with ExecStart pointing at a stub executable.

    ``systemd-analyze verify`` checks that ExecStart's binary exists and is executable,
    and the real one lives in /opt/elastic-supervisor/venv, which a test machine does
    not have. Only that path changes, so everything else is verified as shipped.
    """
    stub = directory / "elastic-supervisor"
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    text = (UNITS / name).read_text()
    assert INSTALLED_BINARY in text
    staged = directory / name
    staged.write_text(text.replace(INSTALLED_BINARY, str(stub)))
    return staged


def systemd_verify(path: Path) -> subprocess.CompletedProcess[str]:
    assert SYSTEMD_ANALYZE is not None
    return subprocess.run(
        [SYSTEMD_ANALYZE, "verify", "--man=no", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@needs_systemd_analyze
@pytest.mark.parametrize(
    ("unit", "verify_as"),
    [
        ("elastic-supervisor.service", "elastic-supervisor.service"),
        ("elastic-supervisor@.service", "elastic-supervisor@.service"),
        # an instance loads the template and expands %i, which checks ExecStart too
        ("elastic-supervisor@.service", "elastic-supervisor@job-1.service"),
    ],
)
def test_unit_passes_systemd_analyze_verify_without_warnings(
    tmp_path: Path, unit: str, verify_as: str
) -> None:
    stage_unit(unit, tmp_path)
    result = systemd_verify(tmp_path / verify_as)
    assert (result.returncode, result.stderr, result.stdout) == (0, "", "")


@needs_systemd_analyze
def test_verify_reports_a_broken_unit(tmp_path: Path) -> None:
    """Guards the verify test itself: warnings do reach stderr."""
    staged = stage_unit("elastic-supervisor.service", tmp_path)
    staged.write_text(staged.read_text().replace("KillMode=mixed", "KillMode=bogus"))
    assert "kill mode" in systemd_verify(staged).stderr


def read_unit(name: str) -> dict[tuple[str, str], list[str]]:
    """``(section, key) -> values``, in order; systemd allows repeated keys."""
    settings: dict[tuple[str, str], list[str]] = {}
    section = ""
    for raw in (UNITS / name).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        settings.setdefault((section, key.strip()), []).append(value.strip())
    return settings


def timespan_seconds(value: str) -> float:
    """Parse a unit time span with systemd's own parser."""
    assert SYSTEMD_ANALYZE is not None
    out = subprocess.run(
        [SYSTEMD_ANALYZE, "timespan", value], capture_output=True, text=True, check=True
    ).stdout
    match = re.search(r"μs: (\d+)", out)
    assert match, out
    return int(match.group(1)) / 1e6


BOTH_UNITS = pytest.mark.parametrize(
    "unit", ["elastic-supervisor.service", "elastic-supervisor@.service"]
)


@BOTH_UNITS
@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("Service", "Type", "notify"),
        ("Service", "NotifyAccess", "main"),
        ("Service", "KillMode", "mixed"),
        ("Service", "Restart", "on-failure"),
        ("Service", "SuccessExitStatus", "143"),
        ("Service", "ExecReload", "/bin/kill -HUP $MAINPID"),
        ("Service", "LimitMEMLOCK", "infinity"),
        ("Service", "OOMPolicy", "continue"),
    ],
)
def test_unit_sets(unit: str, section: str, key: str, value: str) -> None:
    assert read_unit(unit)[(section, key)] == [value]


@BOTH_UNITS
def test_unit_does_not_restart_after_a_config_error_or_a_quarantine(unit: str) -> None:
    assert read_unit(unit)[("Service", "RestartPreventExitStatus")] == ["2", "200"]


@BOTH_UNITS
def test_unit_bounds_the_restart_rate_in_the_unit_section(unit: str) -> None:
    settings = read_unit(unit)
    assert ("Unit", "StartLimitIntervalSec") in settings
    assert int(settings[("Unit", "StartLimitBurst")][0]) >= 1


@needs_systemd_analyze
@BOTH_UNITS
def test_stop_timeout_exceeds_the_default_shutdown_timeout(unit: str) -> None:
    stop = timespan_seconds(read_unit(unit)[("Service", "TimeoutStopSec")][0])
    assert stop >= DEFAULT_SHUTDOWN_TIMEOUT + 10


@needs_systemd_analyze
@BOTH_UNITS
def test_watchdog_is_armed(unit: str) -> None:
    assert timespan_seconds(read_unit(unit)[("Service", "WatchdogSec")][0]) > 0


def test_template_unit_keeps_instances_apart() -> None:
    settings = read_unit("elastic-supervisor@.service")
    assert "--config /etc/elastic-supervisor/%i.toml" in settings[("Service", "ExecStart")][0]
    assert settings[("Service", "RuntimeDirectory")] == ["elastic-supervisor/%i"]
    assert settings[("Service", "LogsDirectory")] == ["elastic-supervisor/%i"]
    assert settings[("Service", "EnvironmentFile")] == [
        "-/etc/default/elastic-supervisor",
        "-/etc/elastic-supervisor/%i.env",
    ]


@pytest.mark.parametrize("name", ["single-node.toml", "etcd-multinode.toml"])
def test_example_config_loads_with_the_daemons_own_parser(name: str) -> None:
    settings = config.build(config.load_file(REPO / "config" / name))
    assert settings.training_script
    # the units' TimeoutStopSec (60 s) leaves room for the shutdown grace
    assert settings.shutdown_timeout <= DEFAULT_SHUTDOWN_TIMEOUT


# ================================================================ notify socket fixture


@dataclass
class NotifySocket:
    """The service manager's end: a bound datagram socket with SO_PASSCRED."""

    sock: socket.socket
    env_value: str  # what NOTIFY_SOCKET holds

    async def receive(self, timeout: float = 2.0) -> tuple[str, int]:
        """Next message and the sender's pid, waiting at most ``timeout`` seconds."""
        with anyio.fail_after(timeout):
            while True:
                await anyio.wait_readable(self.sock)
                try:
                    return self._read()
                except BlockingIOError:
                    continue

    def drain(self) -> list[str]:
        """Every message already queued, without waiting or yielding to the loop."""
        messages = []
        while True:
            try:
                messages.append(self._read()[0])
            except BlockingIOError:
                return messages

    def _read(self) -> tuple[str, int]:
        creds_size = struct.calcsize("3i")
        data, ancillary, _flags, _addr = self.sock.recvmsg(4096, socket.CMSG_SPACE(creds_size))
        pid = -1
        for level, kind, payload in ancillary:
            if (level, kind) == (socket.SOL_SOCKET, socket.SCM_CREDENTIALS):
                pid, _uid, _gid = struct.unpack("3i", payload[:creds_size])
        return data.decode(), pid


@pytest.fixture(params=["path", "abstract"])
def notify_socket(request: pytest.FixtureRequest) -> Iterator[NotifySocket]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    sock.setblocking(False)
    # A short private directory rather than tmp_path: sun_path holds only 108 bytes and
    # pytest's per-test paths grow with the test name.
    directory = tempfile.mkdtemp(prefix="es-notify-")
    try:
        if request.param == "path":
            path = os.path.join(directory, "notify")
            sock.bind(path)
            env_value = path
        else:
            name = f"elastic-supervisor-test/{uuid.uuid4().hex}"
            sock.bind(b"\0" + name.encode())
            env_value = "@" + name
        yield NotifySocket(sock, env_value)
    finally:
        sock.close()
        shutil.rmtree(directory)


@pytest.fixture
def make_notifier() -> Iterator[Callable[..., Notifier]]:
    """Factory: ``make_notifier(env)`` reads a fake environment; all are closed after."""
    made: list[Notifier] = []

    def make(env: dict[str, str]) -> Notifier:
        notifier = Notifier.from_environ(env)
        made.append(notifier)
        return notifier

    yield make
    for notifier in made:
        notifier.close()


# ============================================================================= messages


async def test_ready_carries_status_and_our_pid(
    notify_socket: NotifySocket, make_notifier: Callable[..., Notifier]
) -> None:
    notifier = make_notifier({"NOTIFY_SOCKET": notify_socket.env_value})
    assert notifier.ready("running attempt 1: 2/2 workers")
    message, pid = await notify_socket.receive()
    assert message == "READY=1\nSTATUS=running attempt 1: 2/2 workers"
    assert pid == os.getpid()


@pytest.mark.parametrize(
    ("send", "expected"),
    [
        (lambda n: n.status("rendezvous round 2"), "STATUS=rendezvous round 2"),
        (lambda n: n.status("two\nlines"), "STATUS=two lines"),
        (lambda n: n.stopping(), "STOPPING=1"),
        (lambda n: n.stopping("stopping: SIGTERM"), "STOPPING=1\nSTATUS=stopping: SIGTERM"),
        (lambda n: n.extend_timeout(5_000_000), "EXTEND_TIMEOUT_USEC=5000000"),
        (lambda n: n.watchdog(), "WATCHDOG=1"),
    ],
)
async def test_notifier_sends(
    notify_socket: NotifySocket,
    make_notifier: Callable[..., Notifier],
    send: Callable[[Notifier], bool],
    expected: str,
) -> None:
    notifier = make_notifier({"NOTIFY_SOCKET": notify_socket.env_value})
    assert send(notifier)
    assert (await notify_socket.receive())[0] == expected
    assert (notifier.sent, notifier.errors) == (1, 0)


def test_without_notify_socket_every_call_is_a_no_op(
    make_notifier: Callable[..., Notifier],
) -> None:
    notifier = make_notifier({})
    assert not notifier.enabled
    assert not notifier.ready()
    assert not notifier.watchdog()
    assert (notifier.sent, notifier.errors) == (0, 0)


def test_a_failed_send_is_counted_and_logged_once_not_raised(
    tmp_path: Path, make_notifier: Callable[..., Notifier], caplog: pytest.LogCaptureFixture
) -> None:
    notifier = make_notifier({"NOTIFY_SOCKET": str(tmp_path / "nobody-listens")})
    with caplog.at_level(logging.DEBUG, logger="supervisor.systemd"):
        assert not notifier.ready()
        assert not notifier.watchdog()
    assert notifier.errors == 2
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1


@pytest.mark.parametrize(
    ("value", "address"),
    [
        (None, None),
        ("", None),
        ("/run/systemd/notify", b"/run/systemd/notify"),
        ("@sd-notify", b"\0sd-notify"),
        ("relative/path", None),
        ("vsock:2:1234", None),
    ],
)
def test_parse_notify_socket(value: str | None, address: bytes | None) -> None:
    assert parse_notify_socket(value) == address


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"WATCHDOG_USEC": "200000"}, WatchdogSettings(200_000)),
        ({"WATCHDOG_USEC": "200000", "WATCHDOG_PID": "4242"}, WatchdogSettings(200_000)),
        ({"WATCHDOG_USEC": "200000", "WATCHDOG_PID": "1"}, None),  # another process's
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({"WATCHDOG_USEC": "200000", "WATCHDOG_PID": "me"}, None),
    ],
)
def test_parse_watchdog_follows_sd_watchdog_enabled(
    env: dict[str, str], expected: WatchdogSettings | None
) -> None:
    assert parse_watchdog(env, pid=4242) == expected


def test_ping_interval_is_half_the_watchdog_timeout() -> None:
    assert WatchdogSettings(30_000_000).ping_interval == 15.0


# ============================================================================= watchdog

WATCHDOG_USEC = 200_000  # 200 ms: pings every 100 ms


def watchdog_env(notify: NotifySocket) -> dict[str, str]:
    return {
        "NOTIFY_SOCKET": notify.env_value,
        "WATCHDOG_USEC": str(WATCHDOG_USEC),
        "WATCHDOG_PID": str(os.getpid()),
    }


async def receive_ping(notify: NotifySocket) -> float:
    """Wait for the next WATCHDOG=1 from this process; returns when it arrived."""
    message, pid = await notify.receive(timeout=1.0)
    assert (message, pid) == ("WATCHDOG=1", os.getpid())
    return anyio.current_time()


@pytest.mark.xdist_group("load")  # a timing bound: not beside another test's load
async def test_watchdog_pings_every_half_timeout_from_our_pid(
    notify_socket: NotifySocket, make_notifier: Callable[..., Notifier]
) -> None:
    notifier = make_notifier(watchdog_env(notify_socket))
    async with anyio.create_task_group() as tg:
        assert await tg.start(run_watchdog_pings, notifier) == pytest.approx(0.1)
        await receive_ping(notify_socket)  # the first ping goes out at once
        arrivals = [await receive_ping(notify_socket) for _ in range(6)]
        tg.cancel_scope.cancel()
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert min(gaps) > 0.08  # no faster than every WATCHDOG_USEC/2
    assert max(gaps) < WATCHDOG_USEC / 1e6  # always inside systemd's timeout


async def test_watchdog_pings_are_withheld_while_the_loop_lags(
    notify_socket: NotifySocket, make_notifier: Callable[..., Notifier]
) -> None:
    notifier = make_notifier(watchdog_env(notify_socket))
    probe = LagProbe(max_lag=0.05)
    async with anyio.create_task_group() as tg:
        await tg.start(run_watchdog_pings, notifier, probe)
        await receive_ping(notify_socket)
        notify_socket.drain()
        # This task wedges the loop on purpose, 150 ms at a time, for 1.2 s: six times
        # the ping interval and longer than the whole watchdog timeout. Between blocks
        # it yields, so the ping task runs, but always more than 50 ms late.
        for _ in range(8):
            time.sleep(0.15)
            await anyio.sleep(0)
        assert notify_socket.drain() == []  # read before the ping task runs again
        assert probe.late_wakeups >= 1
        await receive_ping(notify_socket)  # an on-time loop pings again
        tg.cancel_scope.cancel()


async def test_watchdog_task_ends_when_systemd_armed_none(
    notify_socket: NotifySocket, make_notifier: Callable[..., Notifier]
) -> None:
    notifier = make_notifier({"NOTIFY_SOCKET": notify_socket.env_value})
    async with anyio.create_task_group() as tg:
        assert await tg.start(run_watchdog_pings, notifier) is None
    assert notify_socket.drain() == []


def test_lag_probe_judges_lateness_against_its_bound() -> None:
    probe = LagProbe(max_lag=0.5)
    assert probe.observe(0.1, now=10.0)
    assert not probe.observe(0.9, now=11.0)
    assert probe.observe(0.0, now=12.0)
    assert (probe.late_wakeups, probe.worst_lag, probe.last_lag) == (1, 0.9, 0.0)


async def test_extending_timeout_repeats_while_the_body_runs(
    notify_socket: NotifySocket, make_notifier: Callable[..., Notifier]
) -> None:
    notifier = make_notifier({"NOTIFY_SOCKET": notify_socket.env_value})
    async with extending_timeout(notifier, step=0.05):
        first = await notify_socket.receive()
        second = await notify_socket.receive()
    assert first[0] == second[0] == "EXTEND_TIMEOUT_USEC=100000"


async def test_extending_timeout_lets_the_bodys_exception_through_unwrapped(
    notify_socket: NotifySocket, make_notifier: Callable[..., Notifier]
) -> None:
    notifier = make_notifier({"NOTIFY_SOCKET": notify_socket.env_value})
    with pytest.raises(LookupError):
        async with extending_timeout(notifier, step=0.05):
            await notify_socket.receive()
            raise LookupError("stop failed")


async def test_extending_timeout_without_systemd_just_runs_the_body(
    make_notifier: Callable[..., Notifier],
) -> None:
    async with extending_timeout(make_notifier({}), step=0.01):
        pass


# ========================================================================= STATUS lines


def snapshot(phase: str, **changes: object) -> StatusView:
    fields: dict[str, object] = {
        "run_id": "job",
        "phase": phase,
        "attempt": 2,
        "restart_count": 1,
        "max_restarts": 3,
        "restarts_left": 2,
        "world_size": 8,
        "local_world_size": 8,
        "role": "default",
        "published_at": 0.0,
        "started_at_wall": 0.0,
        "workers": tuple(
            WorkerView(local_rank=r, global_rank=r, pid=100 + r, state="running", started_at=0.0)
            for r in range(8)
        ),
    }
    fields.update(changes)
    return StatusView(**fields)  # type: ignore[arg-type]


def failure(attempt: int) -> FailureView:
    return FailureView(
        kind="exited",
        attempt=attempt,
        local_rank=3,
        global_rank=3,
        pid=103,
        exit_code=1,
        signal=None,
        message="",
        description="local rank 3 (pid 103) exited with code 1",
        at_wall=0.0,
    )


@pytest.mark.parametrize(
    ("snap", "line"),
    [
        (snapshot("running"), "running attempt 2: 8/8 workers, restarts 1/3"),
        (snapshot("rendezvous"), "rendezvous round 0, restarts 1/3"),
        (snapshot("starting", workers=()), "starting 8 workers, restarts 1/3"),
        (
            snapshot("backoff", workers=(), last_failure=failure(2)),
            "backoff after attempt 2, restarts 1/3: local rank 3 (pid 103) exited with code 1",
        ),
        (
            snapshot("stopping", last_failure=failure(1)),  # an old failure is not the cause
            "stopping attempt 2: 8/8 workers left",
        ),
        (
            snapshot("failed", workers=(), exit_code=1, last_failure=failure(2)),
            "failed after attempt 2, exit code 1: local rank 3 (pid 103) exited with code 1",
        ),
        (snapshot("stopped", exit_code=143), "stopped, exit code 143"),
    ],
)
def test_format_status(snap: StatusView, line: str) -> None:
    assert format_status(snap) == line


def test_format_status_is_one_bounded_line() -> None:
    view = failure(2)
    long = msgspec.structs.replace(view, description="boom\n" * 100)
    line = format_status(snapshot("failed", exit_code=1, last_failure=long))
    assert "\n" not in line
    assert len(line) <= 200


async def test_status_reporter_sends_changes_ready_once_and_stopping_at_the_end(
    notify_socket: NotifySocket, make_notifier: Callable[..., Notifier]
) -> None:
    reporter = StatusReporter(make_notifier({"NOTIFY_SOCKET": notify_socket.env_value}))
    for snap in [
        snapshot("rendezvous", attempt=0, workers=()),
        snapshot("running"),
        snapshot("running"),  # unchanged: nothing sent
        snapshot("stopped", exit_code=143),
    ]:
        reporter.publish(snap)
    assert notify_socket.drain() == [
        "STATUS=rendezvous round 0, restarts 1/3",
        "READY=1\nSTATUS=running attempt 2: 8/8 workers, restarts 1/3",
        "STOPPING=1\nSTATUS=stopped, exit code 143",
    ]


async def test_status_reporter_sends_stopping_once_on_shutdown(
    notify_socket: NotifySocket, make_notifier: Callable[..., Notifier]
) -> None:
    reporter = StatusReporter(make_notifier({"NOTIFY_SOCKET": notify_socket.env_value}))
    reporter.publish(snapshot("running"))
    reporter.stopping("stopping: SIGTERM received")
    reporter.publish(snapshot("stopping"))
    reporter.publish(snapshot("stopped", exit_code=143))
    assert notify_socket.drain()[1:] == [
        "STOPPING=1\nSTATUS=stopping: SIGTERM received",
        "STATUS=stopping attempt 2: 8/8 workers left",
        "STATUS=stopped, exit code 143",
    ]


# ============================================================================== logging


@pytest.fixture
def restore_root_logger() -> Iterator[None]:
    root = logging.getLogger()
    level = root.level
    yield
    logsetup._remove_ours(root)
    root.setLevel(level)


def run_child_logging(tmp_path: Path, journal_stream: Callable[[os.stat_result], str]) -> str:
    """Run a child whose stderr is a file and whose JOURNAL_STREAM is derived from it."""
    script = textwrap.dedent(
        """
        import logging
        from supervisor.logsetup import configure_logging
        configure_logging("debug")
        log = logging.getLogger("supervisor.test")
        log.debug("d"); log.info("i"); log.warning("w"); log.error("e"); log.critical("c")
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            log.exception("failed")
        """
    )
    err_path = tmp_path / "stderr"
    with err_path.open("w") as err:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        env["JOURNAL_STREAM"] = journal_stream(os.fstat(err.fileno()))
        subprocess.run([sys.executable, "-c", script], stderr=err, env=env, check=True, timeout=60)
    return err_path.read_text()


def test_journal_stream_gets_priority_prefixes_and_no_timestamps(tmp_path: Path) -> None:
    out = run_child_logging(tmp_path, lambda st: f"{st.st_dev}:{st.st_ino}")
    lines = out.splitlines()
    assert lines[:5] == [
        "<7>supervisor.test: d",
        "<6>supervisor.test: i",
        "<4>supervisor.test: w",
        "<3>supervisor.test: e",
        "<2>supervisor.test: c",
    ]
    # journald makes each line an entry: the traceback's lines keep the error priority
    assert all(line.startswith("<3>") for line in lines[5:])
    assert "<3>RuntimeError: boom" in lines
    assert not re.search(r"\d{4}-\d\d-\d\d", out)


def test_a_different_journal_stream_gets_timestamped_text(tmp_path: Path) -> None:
    out = run_child_logging(tmp_path, lambda st: f"{st.st_dev}:{st.st_ino + 1}")
    first = out.splitlines()[0]
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} DEBUG +supervisor\.test: d", first)


@pytest.mark.usefixtures("restore_root_logger")
def test_json_lines_carry_level_logger_message_and_extras() -> None:
    stream = io.StringIO()
    logsetup.configure_logging("info", "json", stream)
    log = logging.getLogger("supervisor.test")
    log.debug("hidden")
    log.warning("rank %d failed", 3, extra={"rank": 3})
    record = json.loads(stream.getvalue())
    assert record["level"] == "WARNING"
    assert record["logger"] == "supervisor.test"
    assert record["message"] == "rank 3 failed"
    assert record["rank"] == 3
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00", record["ts"])


@pytest.mark.usefixtures("restore_root_logger")
def test_json_on_the_journal_stream_gets_a_priority_prefix(tmp_path: Path) -> None:
    with (tmp_path / "journal").open("w") as stream:
        st = os.fstat(stream.fileno())
        environ = {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
        logsetup.configure_logging("info", "json", stream, environ=environ)
        logging.getLogger("supervisor.test").error("bad")
    line = (tmp_path / "journal").read_text()
    assert line.startswith("<3>{")
    assert json.loads(line[3:])["message"] == "bad"


@pytest.mark.usefixtures("restore_root_logger")
def test_configuring_twice_replaces_the_handler() -> None:
    first, second = io.StringIO(), io.StringIO()
    logsetup.configure_logging("info", "text", first)
    logsetup.configure_logging("info", "text", second)
    logging.getLogger("supervisor.test").info("once")
    assert first.getvalue() == ""
    assert second.getvalue().count("once") == 1


@pytest.mark.usefixtures("restore_root_logger")
def test_reopen_follows_a_rotated_log_file(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "supervisor.log"
    logsetup.configure_logging("info", "auto", log_file=path)
    log = logging.getLogger("supervisor.test")
    log.info("before rotation")
    path.rename(path.with_suffix(".log.1"))  # what logrotate does before postrotate
    assert logsetup.reopen() == 1
    log.info("after rotation")
    assert "before rotation" in path.with_suffix(".log.1").read_text()
    assert "after rotation" not in path.with_suffix(".log.1").read_text()
    assert "after rotation" in path.read_text()


def test_reopen_without_a_log_file_does_nothing() -> None:
    assert logsetup.reopen() == 0


@pytest.mark.parametrize(("level", "fmt"), [("loud", "auto"), ("info", "xml")])
@pytest.mark.usefixtures("restore_root_logger")
def test_unknown_level_or_format_is_a_value_error(level: str, fmt: str) -> None:
    with pytest.raises(ValueError):
        logsetup.configure_logging(level, fmt, io.StringIO())  # type: ignore[arg-type]


def test_stream_without_a_file_descriptor_is_not_the_journal() -> None:
    assert not logsetup.stream_is_journal(io.StringIO(), {"JOURNAL_STREAM": "1:2"})
