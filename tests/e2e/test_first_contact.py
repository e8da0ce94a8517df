"""First contact: what a new user meets. Every bad input from the outside world at
start-up is one line naming the setting and exit 2; a busy default health port moves to a
free one; one attempt number everywhere; the test suite itself skips what is missing."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import aiohttp
import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families

from supervisor.config import DEFAULT_HEALTH_PORT, advisories, build, load_file
from supervisor.rendezvous.registry import backend_advisories
from tests.support import deps
from tests.support.daemon import Supervised, supervisor
from tests.support.notify import notify_socket, receive_notification
from tests.support.paths import FAKE_WORKER, REPO

HELLO = str(REPO / "examples" / "hello.py")


def cli(*args: str, env: dict[str, str] | None = None,
        cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m supervisor ARGS`` to the end; environment: ours plus ``env``."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    full.pop("NOTIFY_SOCKET", None)
    return subprocess.run([sys.executable, "-m", "supervisor", *args], capture_output=True,
                          text=True, timeout=60, env={**full, **(env or {})}, cwd=cwd or REPO)


def one_line_error(result: subprocess.CompletedProcess[str], *fragments: str) -> str:
    """Exit 2 and a stderr that is exactly one line containing every fragment."""
    lines = result.stderr.splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@contextmanager
def listening(port: int = 0, host: str = "0.0.0.0") -> Iterator[int]:
    """A socket listening on ``port`` (0: any); yields the port. If someone else already
    holds ``port``, it is busy anyway: yield it without owning it."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(1)
    except OSError as exc:
        sock.close()
        if exc.errno != errno.EADDRINUSE or port == 0:
            raise
        yield port
        return
    with sock:
        yield sock.getsockname()[1]


# ------------------------------------------------------------------ start-up errors


@pytest.mark.parametrize(
    "how", ["flag", "file", "PET_HEALTH_PORT", "TORCHELASTIC_HEALTH_CHECK_PORT"]
)
def test_a_busy_port_that_was_chosen_is_one_line_and_exit_2(tmp_path: Path, how: str) -> None:
    with listening() as port:
        args: list[str] = ["--log-dir", str(tmp_path)]
        env: dict[str, str] = {}
        if how == "flag":
            args += ["--health-port", str(port)]
        elif how == "file":
            (tmp_path / "c.toml").write_text(f"health_port = {port}\n")
            args += ["--config", str(tmp_path / "c.toml")]
        else:
            env[how] = str(port)
        result = cli("run", *args, HELLO, env=env)
    one_line_error(result, "health_port", f":{port}", "already in use")


@pytest.mark.parametrize(
    ("host", "fragments"),
    [("no-such-host.invalid", ("health_host", "cannot resolve 'no-such-host.invalid'")),
     ("192.0.2.1", ("health_host", "192.0.2.1 is not an address of this machine"))],
)
def test_an_unusable_health_host_is_one_line(host: str, fragments: tuple[str, ...],
                                            tmp_path: Path) -> None:
    result = cli("run", "--health-host", host, "--health-port", "0", HELLO,
                 env={"TMPDIR": str(tmp_path)})
    one_line_error(result, *fragments)
    # without --log-dir the start made a fresh log directory in TMPDIR: a start that
    # failed removes it again (it held only an empty event log)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_start_keeps_a_log_directory_that_was_given(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    result = cli("run", "--health-host", "192.0.2.1", "--health-port", "0",
                 "--log-dir", str(logs), HELLO)
    one_line_error(result, "health_host")
    assert (logs / "none" / "events.jsonl").is_file()  # the user's directory: left alone


def test_an_unknown_master_addr_is_one_line() -> None:
    result = cli("run", "--health-port", "0", "--master-addr", "no-such-host.invalid", HELLO)
    one_line_error(result, "master_addr: cannot resolve 'no-such-host.invalid'")


@pytest.mark.parametrize(
    ("flag", "setting"),
    [("--log-dir", "log_dir"), ("--event-log", "event_log"), ("--timer-file", "timer_file")],
)
def test_an_unusable_path_is_one_line_naming_the_setting(
    tmp_path: Path, flag: str, setting: str
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    path = blocker / "below" / ("x.jsonl" if setting == "event_log" else "x")
    args = ["--log-dir", str(tmp_path / "logs")] if flag != "--log-dir" else []
    result = cli("run", "--health-port", "0", *args, flag, str(path), HELLO)
    one_line_error(result, f"{setting}:", str(blocker))


def test_a_log_dir_that_is_not_writable_is_one_line(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        # root writes anywhere; a read-only place is the equivalent
        target = "/proc/elastic-supervisor-logs"
    else:
        target = str(tmp_path / "ro")
        os.mkdir(target, 0o500)
    one_line_error(cli("run", "--health-port", "0", "--log-dir", target, HELLO), "log_dir:")


@pytest.mark.parametrize(
    ("args", "fragment"),
    [(["/nonexistent/train.py"], "training_script: no such file"),
     (["--no-python", "no-such-command-xyz"], "training_script: command not found"),
     (["--config", "/nonexistent.toml", HELLO], "config file not found"),
     (["--hang-dump", "signal:SIGKILL", HELLO], "hang_dump: signal 'SIGKILL' cannot trigger"),
     (["--nnodes", "2", "--master-addr", "", HELLO], "master_addr: cannot resolve ''")],
)
def test_a_missing_script_command_or_file_is_one_line(args: list[str], fragment: str) -> None:
    one_line_error(cli("run", "--health-port", "0", *args), fragment)


def test_a_port_variable_that_is_not_a_number_is_one_line() -> None:
    result = cli("run", HELLO, env={"TORCHELASTIC_HEALTH_CHECK_PORT": "abc"})
    assert one_line_error(result).endswith("health_port: Expected int, got str")


def test_py_spy_asked_for_and_missing_is_a_start_up_error(tmp_path: Path) -> None:
    from supervisor.watchdog.escalate import resolve_hang_dump

    python = str(tmp_path / "python")  # no py-spy beside it
    with pytest.raises(ValueError, match=r"^py-spy not found on PATH or in .*hang-dump"):
        resolve_hang_dump("py-spy", {"PATH": str(tmp_path)}, python)
    fake = tmp_path / "py-spy"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    found = resolve_hang_dump("py-spy", {"PATH": str(tmp_path)}, python).py_spy
    assert found == str(fake)


# ------------------------------------------------------------------ the command line


def test_a_bare_command_prints_the_usage_and_exits_2() -> None:
    result = cli()
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("usage: elastic-supervisor")
    assert "give a command (run, check-config, status, node)" in result.stderr
    run = cli("run")
    assert run.returncode == 2
    assert run.stderr.startswith("usage: elastic-supervisor run [FLAGS] [--] SCRIPT")


def test_top_level_help_describes_every_command() -> None:
    result = cli("--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())  # argparse wraps lines
    assert "run run a worker group under supervision" in text
    assert "check-config validate a TOML config file" in text
    assert "status show a running supervisor's state" in text


def _closed_stdout(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the CLI with a stdout pipe whose reader is gone before anything was written
    (what `... | head -1` does to the rest of the output)."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run([sys.executable, "-m", "supervisor", *args], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=60, cwd=REPO)
    finally:
        os.close(write)


def test_a_closed_stdout_pipe_ends_quietly(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('training_script = "train.py"\nnproc_per_node = "2"\n')
    for args in (["check-config", str(config)], ["--help"], ["status", "--help"]):
        result = _closed_stdout(*args)
        # 141 (as a shell reports SIGPIPE) where the write failed; argparse's help
        # printer swallows the error itself and exits 0
        assert result.stderr == "", (args, result.stderr)
        assert result.returncode == (0 if "--help" in args else 141), args


# ------------------------------------------------------------------ backend warnings


def test_settings_the_backend_ignores_are_named() -> None:
    settings = build({
        "training_script": "x.py", "rdzv_endpoint": "etcd:2379", "rdzv_conf": "a=1",
    })
    assert not advisories(settings)  # the config names no backend: the registry does
    notes = [text for _, text in backend_advisories(settings)]
    assert [n.split(":")[0] for n in notes] == ["rdzv_endpoint", "rdzv_conf"]
    plain = build({"training_script": "x.py"})
    assert not advisories(plain) and not backend_advisories(plain)


def test_static_with_two_nodes_says_the_other_node_was_not_checked(tmp_path: Path) -> None:
    result = cli("run", "--health-port", "0", "--nnodes", "2", "--rdzv-endpoint", "h:1",
                 "--master-port", "0", "--log-dir", str(tmp_path), HELLO)
    assert result.returncode == 0, result.stderr
    assert "WARNING  supervisor.app: rdzv_endpoint: ignored by the static backend" in (
        result.stderr)
    assert "nothing checks that the other nodes take part" in result.stderr
    assert "job succeeded after 0 restart(s) on this node (static backend: the other nodes " \
           "were not checked)" in result.stderr


# ------------------------------------------------------------------ stops and summaries


async def test_a_clean_stop_by_signal_is_info_not_error(tmp_path: Path) -> None:
    args = ["--health-port", "0", "--log-dir", str(tmp_path), FAKE_WORKER, "--hang"]
    async with supervisor(args) as sup:
        await sup.out.expect(r"^ready 0 ")
        sup.signal(signal.SIGTERM)
        assert await sup.wait() == 128 + signal.SIGTERM
    assert "INFO     supervisor.controller: job stopped (exit code 143)" in sup.err.text()
    assert not [line for line in sup.err.lines if " ERROR " in line], sup.err.text()


def _summary(stderr: str) -> list[str]:
    lines = stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if line.endswith("failure summary:"))
    return [line.strip() for line in lines[start + 1:] if line.startswith("  ")]


def _started(log_dir: Path) -> list[int]:
    path = log_dir / "none" / "events.jsonl"
    return [e["attempt"] for e in map(json.loads, path.read_text().splitlines())
            if e["event"] == "group_started"]


def test_one_attempt_number_continues_across_runs_and_names_existing_files(
    tmp_path: Path,
) -> None:
    base = ["run", "--health-port", "0", "--log-dir", str(tmp_path), "--nproc-per-node", "2"]
    # run 1: attempt 0 fails (nothing redirected, no error file), attempt 1 succeeds
    first = cli(*base, "--max-restarts", "1", FAKE_WORKER, "--fail-rank", "1",
                "--fail-attempts", "1", "--exit", "3")
    assert first.returncode == 0, first.stderr
    assert _started(tmp_path) == [0, 1]
    # run 2: its only attempt is attempt_2; the failing rank wrote an error file and its
    # output went to files, so the summary names exactly those
    second = cli(*base, "--redirects", "3", FAKE_WORKER, "--fail-rank", "1", "--exit", "3",
                 "--error-message", "boom")
    assert second.returncode == 3, second.stderr
    rank_dir = tmp_path / "none" / "attempt_2" / "1"
    assert _summary(second.stderr)[1:4] == [
        "rank 1 (local 1), attempt 2",
        f"error file: {rank_dir / 'error.json'}",
        f"logs: {rank_dir / 'stdout.log'}, {rank_dir / 'stderr.log'}",
    ]
    # run 3: nothing redirected, no error file: neither is named
    third = cli(*base, FAKE_WORKER, "--fail-rank", "1", "--exit", "3")
    assert third.returncode == 3
    summary = _summary(third.stderr)
    assert summary[1] == "rank 1 (local 1), attempt 3"
    assert not [s for s in summary if s.startswith(("error file", "logs"))], summary
    assert "output: on the console above" in summary[2]
    assert _started(tmp_path) == [0, 1, 2, 3]
    assert sorted(p.name for p in (tmp_path / "none").glob("attempt_*")) == [
        f"attempt_{k}" for k in range(4)]


# ------------------------------------------------------------------ the default health port


async def _status_messages(sock: socket.socket, sup: Supervised) -> list[str]:
    seen: list[str] = []
    with anyio.fail_after(15):
        while not any("READY=1" in m for m in seen):
            pid, message = await receive_notification(sock)
            assert pid == sup.pid
            seen.append(message)
    return seen


async def test_a_busy_default_health_port_moves_to_a_free_one(tmp_path: Path) -> None:
    """Two jobs with default settings on one host: the second warns in one line, listens
    on a free port, and /status, STATUS=, /metrics, events and the directory all say the
    same attempt number (5 here: an earlier run left attempt_0..attempt_4)."""
    for k in range(5):
        (tmp_path / "logs" / "none" / f"attempt_{k}").mkdir(parents=True)
    args = ["--log-dir", str(tmp_path / "logs"), FAKE_WORKER, "--hang"]
    env = {"NOTIFY_SOCKET": str(tmp_path / "notify")}
    with listening(DEFAULT_HEALTH_PORT), notify_socket(tmp_path / "notify") as notify:
        async with supervisor(args, env=env) as sup:
            warning = await sup.err.expect(
                rf"WARNING .*health_port: the default port {DEFAULT_HEALTH_PORT} is busy "
                r".*listening on free port (\d+) instead")
            port = int(warning.group(1))
            await sup.err.expect(rf"health endpoint on http://0\.0\.0\.0:{port}$")
            messages = await _status_messages(notify, sup)
            url = f"http://127.0.0.1:{port}"
            async with aiohttp.ClientSession() as session:
                async with session.get(url + "/status") as resp:
                    doc = await resp.json()
                async with session.get(url + "/metrics") as resp:
                    metrics = await resp.text()
            # `status | head -1` against the real daemon: quiet
            closed = await anyio.to_thread.run_sync(_closed_stdout, "status", "--url", url)
            assert (closed.returncode, closed.stderr) == (141, "")
            sup.signal(signal.SIGTERM)
            assert await sup.wait() == 128 + signal.SIGTERM
    assert doc["attempt"] == 5
    assert doc["status"] == f"running attempt 5: 1/1 workers, restarts 0/0, health port {port}"
    assert any(f"STATUS=running attempt 5: 1/1 workers, restarts 0/0, health port {port}" in m
               for m in messages), messages
    gauges = {s.name: s.value for f in text_string_to_metric_families(metrics)
              for s in f.samples}
    assert gauges["elastic_supervisor_attempt"] == 5
    assert _started(tmp_path / "logs") == [5]
    assert (tmp_path / "logs" / "none" / "attempt_5" / "0").is_dir()


# ------------------------------------------------------------------ the test suite itself


def test_missing_dependencies_skip_or_fail_under_require_deps(tmp_path: Path) -> None:
    """tests/support/deps.py and conftest's hooks, on a tiny suite with torch hidden the way .ci/run
    hides it: skips saying how to install; ELASTIC_SUPERVISOR_REQUIRE_DEPS=1 fails them,
    a bare importorskip included."""
    (tmp_path / "py" / "torch").mkdir(parents=True)
    (tmp_path / "py" / "torch" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n")
    (tmp_path / "suite").mkdir()
    (tmp_path / "suite" / "test_x.py").write_text(
        "import pytest\n\n"
        "@pytest.mark.torch\ndef test_torch():\n    import torch  # noqa: F401\n\n"
        "@pytest.mark.etcd\ndef test_etcd():\n    pass\n\n"
        "def test_bare():\n    pytest.importorskip('no_such_module_at_all')\n\n"
        "def test_plain():\n    pass\n")
    (tmp_path / "suite" / "pytest.ini").write_text("[pytest]\n")
    # no plugin autoload: the tiny suite needs none of them, and loading schemathesis,
    # hypothesis and the rest costs ~3.5 s of CPU per run
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "py"), str(REPO)]),
           "PATH": str(tmp_path / "no-bin"), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    env.pop("ELASTIC_SUPERVISOR_REQUIRE_DEPS", None)
    command = [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider",
               "-rs", "-q", "test_x.py"]

    def run(**extra: str) -> str:
        done = subprocess.run(command, cwd=tmp_path / "suite", env={**env, **extra},
                              capture_output=True, text=True, timeout=120)
        return done.stdout + done.stderr

    relaxed = run()
    assert "1 passed, 3 skipped" in relaxed, relaxed
    assert "pip install torch==2.13.0" in relaxed
    assert "apt-get install etcd-server" in relaxed
    strict = run(ELASTIC_SUPERVISOR_REQUIRE_DEPS="1")
    # the markers' checks fail in setup (errors), the bare importorskip in the call
    assert "1 failed, 1 passed, 2 errors" in strict, strict
    assert "During handling" not in strict


@pytest.mark.prometheus
def test_the_prometheus_example_is_valid_and_scrapes_the_configured_port() -> None:
    promtool = deps.need_binary("promtool", "apt-get install prometheus (.ci/run does)")
    example = REPO / "config" / "prometheus.yml"
    checked = subprocess.run([promtool, "check", "config", str(example)], capture_output=True,
                             text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    ports = set(re.findall(r'"[^"]+:(\d+)"', example.read_text()))
    configured = {str(load_file(p)["health_port"]) for p in (REPO / "config").glob("*.toml")}
    assert ports == configured == {str(DEFAULT_HEALTH_PORT)}


def test_the_status_command_is_one_line_when_nothing_answers() -> None:
    with listening() as port:
        pass  # a port nothing listens on any more
    result = cli("status", "--url", f"http://127.0.0.1:{port}")
    assert result.returncode == 1 and len(result.stderr.splitlines()) == 1
    assert "is a supervisor running here?" not in result.stderr  # only for the default URL
    assert result.stderr.startswith(f"elastic-supervisor status: cannot reach http://127.0.0.1:{port}")


@pytest.mark.parametrize("setpriv", ["missing", "old"])
def test_a_missing_or_old_setpriv_falls_back_and_says_so(tmp_path: Path, setpriv: str) -> None:
    """util-linux before 2.33 has a setpriv without --pdeathsig; a minimal image has none.
    Either way workers get their death signal from the Python shim, and the log says so."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if setpriv == "old":
        fake = bin_dir / "setpriv"  # answers --help like util-linux 2.32, fails otherwise
        fake.write_text("#!/bin/sh\n[ \"$1\" = --help ] && echo ' --reuid <uid>' && exit 0\n"
                        "exit 1\n")
        fake.chmod(0o755)
    result = cli("run", "--health-port", "0", "--log-dir", str(tmp_path / "logs"),
                 "--nproc-per-node", "2", HELLO, env={"PATH": str(bin_dir)})
    assert result.returncode == 0, result.stderr
    expected = ("no setpriv on PATH" if setpriv == "missing"
                else f"{bin_dir / 'setpriv'} rejects --pdeathsig")
    assert f"worker death signal: Python shim ({expected}" in result.stderr
    assert result.stdout.count("hello from rank") == 2
