"""Fuzzing every input the supervisor parses: deadline FIFO lines, config values and
files, command lines, and the HTTP API of a real daemon (schemathesis, shipped OpenAPI).

Examples are bounded so the file stays fast; ``HYPOTHESIS_PROFILE``-style tuning is left
to hypothesis' own settings. A bug found here gets an explicit regression test.
"""

from __future__ import annotations

import json
import math
import os
import string
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import anyio.to_thread
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from supervisor.cli import parse_run_args
from supervisor.config import FIELDS, ConfigError, build, load_file
from supervisor.core.deadlines import (
    MAX_PID,
    MAX_SIGNAL,
    PIPE_BUF,
    Rejected,
    RejectReason,
    TimerRequest,
    encode_request,
    parse_request,
)
from supervisor.health.server import load_openapi
from supervisor.watchdog.fifo import LineBuffer
from supervisor.workers.errorfile import read_error_file
from tests.support.daemon import supervisor
from tests.support.paths import FAKE_WORKER, REPO

# ------------------------------------------------------------------ the deadline FIFO

PARSE_REASONS = {
    RejectReason.OVERSIZED, RejectReason.MALFORMED, RejectReason.NOT_OBJECT,
    RejectReason.MISSING_FIELD, RejectReason.BAD_TYPE, RejectReason.BAD_VERSION,
    RejectReason.BAD_PID, RejectReason.BAD_EXPIRATION, RejectReason.BAD_SIGNAL,
}
"""What ``parse_request`` may answer; the other reasons need the process table."""

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
    | st.integers(min_value=10**300, max_value=10**400),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=8,
)
field_values = {
    "version": st.just(1) | json_values,
    "pid": st.integers(min_value=-5, max_value=MAX_PID + 5) | json_values,
    "scope_id": st.text(max_size=40) | json_values,
    "expiration_time": st.floats() | st.integers() | st.just(-1) | json_values,
    "signal": st.integers(min_value=-2, max_value=MAX_SIGNAL + 2) | json_values,
}
request_objects = st.fixed_dictionaries({}, optional=field_values).flatmap(
    lambda obj: st.dictionaries(st.text(max_size=6), json_values, max_size=2).map(
        lambda extra: {**extra, **obj}
    )
)


def _dumps(obj: object) -> bytes:
    return json.dumps(obj, allow_nan=True).encode(errors="surrogatepass")


fifo_lines = st.one_of(
    st.binary(max_size=300),
    st.binary(min_size=PIPE_BUF - 2, max_size=PIPE_BUF + 2),
    request_objects.map(_dumps),
    json_values.map(_dumps),
    request_objects.map(_dumps).map(lambda b: b + b"\n"),
    st.integers(min_value=1, max_value=PIPE_BUF).map(lambda n: b"[" * n),
)


@settings(max_examples=600, deadline=None)
@given(line=fifo_lines)
@example(line=b"[" * PIPE_BUF)  # deep nesting: RecursionError inside json
@example(line=b'{"version":1,"pid":5,"scope_id":"s","expiration_time":1%s,"signal":9}' % (
    b"0" * 400))  # an integer too large for a float
@example(line=b'{"version":1,"pid":5,"scope_id":"s","expiration_time":NaN,"signal":9}')
@example(line=b'{"version":true,"pid":5,"scope_id":"s","expiration_time":1,"signal":9}')
@example(line=b"\xff\xfe")
def test_parse_request_answers_a_request_or_a_documented_rejection(line: bytes) -> None:
    result = parse_request(line)
    if isinstance(result, Rejected):
        assert result.reason in PARSE_REASONS
        assert isinstance(result.detail, str)
        return
    assert isinstance(result, TimerRequest)
    assert 0 < result.pid <= MAX_PID
    assert math.isfinite(result.expiration_time)
    assert (0 if result.is_release else 1) <= result.signal <= MAX_SIGNAL
    wire = encode_request(result)
    if len(wire) - 1 <= PIPE_BUF:
        assert parse_request(wire) == result  # what we accept, we can also say


@settings(max_examples=300, deadline=None)
@given(chunks=st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"\r", b"\n")),
                       max_size=12),
       max_line=st.integers(min_value=1, max_value=24))
def test_line_buffer_frames_like_split_and_never_holds_more_than_a_line(
    chunks: list[bytes], max_line: int
) -> None:
    buffer = LineBuffer(max_line)
    lines: list[bytes] = []
    dropped = 0
    for chunk in chunks:
        got, lost = buffer.feed(chunk)
        lines += got
        dropped += lost
        assert buffer.pending <= max_line
    *complete, rest = b"".join(chunks).split(b"\n")
    assert lines == [p for p in complete if 0 < len(p) <= max_line]
    assert dropped == sum(len(p) > max_line for p in [*complete, rest])
    assert buffer.pending == (len(rest) if len(rest) <= max_line else 0)


# ------------------------------------------------------------------ worker error files

error_documents = st.one_of(
    st.binary(max_size=400),
    json_values.map(_dumps),
    st.fixed_dictionaries({"message": json_values | st.fixed_dictionaries(
        {}, optional={"message": json_values, "extraInfo": json_values})},
        optional={"timestamp": json_values}).map(_dumps),
)


@settings(max_examples=300, deadline=None)
@given(document=error_documents)
def test_error_file_reader_never_raises(document: bytes) -> None:
    """A worker writes its error file: whatever it wrote, the reader answers a report
    or None."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "error.json"
        path.write_bytes(document)
        report = read_error_file(path)
    assert report is None or isinstance(report.summary, str)


def test_deeply_nested_error_file_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    path.write_text("[" * 100_000)
    assert read_error_file(path) is None


def test_error_file_with_a_huge_integer_timestamp_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    path.write_text('{"message": "boom", "timestamp": 1%s}' % ("0" * 400))
    report = read_error_file(path)
    assert report is not None and report.timestamp is None


def test_error_file_that_is_a_fifo_does_not_block(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    os.mkfifo(path)
    reader = threading.Thread(target=read_error_file, args=(path,), daemon=True)
    reader.start()
    reader.join(timeout=2)
    blocked = reader.is_alive()
    if blocked:  # let the blocked open() return: a writer comes and goes
        os.close(os.open(path, os.O_WRONLY))
        reader.join(timeout=5)
    assert not blocked


# ------------------------------------------------------------------ configuration


config_values = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=-3, max_value=70000),
    st.floats(), st.text(max_size=12),
    st.text(alphabet=string.digits + ":.,-eE ", max_size=8),
    st.sampled_from(["0", "1", "2:2", "1:3", "cpu", "auto", "gpu", "etcd", "static",
                     "signal:SIGUSR1", "py-spy", "none", "SIGTERM,SIGFOO", "0:5", "3", "²",
                     "\u0661", "1e400", "nan", "-inf", "spawn", "fork", "node", "json"]),
    st.lists(st.integers(min_value=-5, max_value=300) | st.text(max_size=4), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
config_layers = st.dictionaries(
    st.sampled_from(sorted(FIELDS)) | st.text(max_size=10), config_values, max_size=6
)


def _one_line_config_error(exc: ConfigError) -> None:
    text = str(exc)
    assert text and "\n" not in text and "\r" not in text, repr(text)


@settings(max_examples=500, deadline=None)
@given(layers=st.lists(config_layers, min_size=1, max_size=3))
def test_settings_only_ever_fail_with_a_one_line_config_error(
    layers: list[dict[str, Any]],
) -> None:
    try:
        build(*layers)
    except ConfigError as exc:
        _one_line_config_error(exc)


def _toml_value(value: Any) -> str | None:
    """A TOML rendering of ``value`` (None: TOML cannot say it; the key is left out)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") \
            if math.isinf(value) else repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        items = [v for v in map(_toml_value, value) if v is not None]
        return "[" + ", ".join(items) + "]"
    items = [f"{json.dumps(k)} = {v}" for k, v in ((k, _toml_value(x)) for k, x in value.items())
             if v is not None]
    return "{" + ", ".join(items) + "}"


def _toml_document(layer: dict[str, Any]) -> str:
    lines = []
    for key, value in layer.items():
        rendered = _toml_value(value)
        if rendered is not None:
            lines.append(f"{json.dumps(key, ensure_ascii=False)} = {rendered}")
    return "\n".join(lines) + "\n"


config_files = st.one_of(
    config_layers.map(_toml_document).map(lambda t: t.encode(errors="surrogatepass")),
    st.text(max_size=200).map(lambda t: t.encode(errors="surrogatepass")),
    st.binary(max_size=100),
    st.sampled_from([b"[section]\nmax_restarts = 1\n", b"a = 1\na = 2\n", b"x = \n",
                     b"max_restarts = 99999999999999999999999\n", b"\xef\xbb\xbfrole = 'x'\n"]),
)


@settings(max_examples=300, deadline=None)
@given(document=config_files)
def test_config_files_only_ever_fail_with_a_one_line_config_error(document: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.toml"
        path.write_bytes(document)
        try:
            layer = load_file(path)
            build(layer)
        except ConfigError as exc:
            _one_line_config_error(exc)


def test_non_ascii_digit_count_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        build({"training_script": "x.py", "nproc_per_node": "²"})


@pytest.mark.filterwarnings("ignore::ResourceWarning")  # the bug leaves os.scandir open
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_stray_attempt_directory_does_not_stop_the_start(tmp_path: Path) -> None:
    from supervisor.workers.group import _next_attempt_index

    for name in ("attempt_3", "attempt_²", "attempt_x", "attempt_"):
        (tmp_path / name).mkdir()
    assert _next_attempt_index(tmp_path) == 4


# ------------------------------------------------------------------ the command line

# flags whose bad values are caught while the command line is parsed and validated
PARSE_TIME_BAD: list[list[str]] = [
    *(["--nnodes", v] for v in ["0", "x", "3:1", "", "-1", "1:2", "1:2:3"]),
    *(["--nproc-per-node", v] for v in ["0", "-2", "x", "gpu", "1.5", ""]),
    *(["--node-rank", v] for v in ["-1", "x", "1"]),
    *(["--max-restarts", v] for v in ["-1", "many", "1e3", "1.5"]),
    *(["--rdzv-backend", v] for v in ["zookeeper", "c10d2", ""]),
    *(["--master-port", v] for v in ["-1", "70000", "x"]),
    *(["--shutdown-timeout", v] for v in ["-1", "x", "nan"]),
    *(["--progress-timeout", v] for v in ["0", "-1", "nan"]),
    *(["--health-port", v] for v in ["-1", "65536", "x"]),
    *(["--restart-backoff", v] for v in ["x", "5:1", "-1:2", "1", "1.2.3:4"]),
    *(["--restart-budget-window", v] for v in ["0", "-3"]),
    *(["--hang-dump", v] for v in ["gdb", "signal:SIGFOO", "signal:"]),
    *(["--no-restart-exit-codes", v] for v in ["a,b", "300", "-1"]),
    *(["--signals-to-handle", v] for v in ["SIGFOO", "TERM"]),
    *(["--loop-nice", v] for v in ["1", "-21", "x"]),
    ["--exit-barrier-timeout", "-5"], ["--hang-state-timeout", "0"],
    ["--numa-binding", "galaxy"], ["--log-level", "verbose"], ["--log-format", "xml"],
    ["--start-method", "thread"], ["--restart-exit-codes", "256"], ["--logs-specs", "x"],
    ["--config", "/nonexistent/cfg.toml"], ["--config", "/"], ["--module", "--no-python"],
    # "--max-restart 3" is no longer bad: a prefix of --max-restarts, as torchrun takes it
    ["--rdzv-backend", "etcd"], ["--frobnicate"], ["--max-restarts-", "3"], ["-x"],
    ["--r", "3"],  # an ambiguous prefix
    ["--max-restarts"], ["--nproc-per-node", "--max-restarts", "1"],
]
# bad values caught when the daemon starts (output plan, rendezvous backend)
START_TIME_BAD: list[list[str]] = [
    *(["--redirects", v] for v in ["9", "x", "0:5", "a:1"]),
    *(["--tee", v] for v in ["4", "x"]),
    *(["--local-ranks-filter", v] for v in ["x", "-1"]),
    *(["--rdzv-backend", "etcd", "--rdzv-endpoint", "127.0.0.1:9", "--rdzv-conf", v]
      # an unknown key is ignored with a warning, as torchrun ignores it: not bad
      for v in ["foo", "timeout=-1", "protocol=ftp", "lease_ttl=x", "'lease_ttl=x'"]),
    *(["--rdzv-backend", "etcd", "--rdzv-endpoint", v] for v in ["http://:0", "ftp://x"]),
]
HARMLESS: list[list[str]] = [
    ["--role", "trainer"], ["--max-restarts", "2"], ["--shutdown-timeout", "3"],
    ["--log-level", "warning"], ["--monitor-interval", "0.5"], ["--redirects", "3"],
    ["--progress-timeout", "5"], ["--restart-backoff", "0:1"], ["--no-watchdog"],
]


def _flags(bad: list[list[str]]) -> st.SearchStrategy[list[str]]:
    """1-2 bad flags and 0-2 harmless ones that do not set the same options."""

    @st.composite
    def build_argv(draw: st.DrawFn) -> list[str]:
        chosen = draw(st.lists(st.sampled_from(bad), min_size=1, max_size=2))
        used = {token for flags in chosen for token in flags if token.startswith("--")}
        noise = [f for f in HARMLESS if f[0] not in used]
        extra = draw(st.lists(st.sampled_from(noise), max_size=2))
        parts = draw(st.permutations([*chosen, *extra]))
        return [token for part in parts for token in part]

    return build_argv()


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flags=_flags(PARSE_TIME_BAD))
def test_bad_flags_are_refused_while_parsing(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises((SystemExit, ConfigError)) as info:
        parse_run_args([*flags, FAKE_WORKER], {})
    if isinstance(info.value, SystemExit):
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
    else:
        assert isinstance(info.value, ConfigError)
        _one_line_config_error(info.value)


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(flags=_flags(PARSE_TIME_BAD + START_TIME_BAD))
def test_bad_command_lines_exit_2_with_one_stderr_line(tmp_path: Path, flags: list[str]) -> None:
    """Each example is a real ``python -m supervisor run`` process."""
    argv = [sys.executable, "-m", "supervisor", "run", "--health-port", "0", "--log-dir",
            str(tmp_path / "logs"), *flags, FAKE_WORKER]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=REPO,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = result.stderr.splitlines()
    assert (result.returncode, len(lines)) == (2, 1), (flags, result.stderr)
    assert "Traceback" not in result.stderr


# ------------------------------------------------------------------ the HTTP API


async def test_schemathesis_against_a_real_daemon_finds_no_5xx_or_contract_violation(
    tmp_path: Path,
) -> None:
    """The shipped OpenAPI document, as the running daemon serves it, fuzzed against that
    daemon while its group keeps failing and restarting (every phase answers)."""
    schemathesis = pytest.importorskip("schemathesis")
    args = ["--health-port", "0", "--health-host", "127.0.0.1", "--nproc-per-node", "2",
            "--max-restarts", "100000", "--restart-backoff", "0.2:0.2", "--log-dir",
            str(tmp_path), FAKE_WORKER, "--exit", "3", "--fail-rank", "1", "--hang"]
    async with supervisor(args) as sup:
        port = await sup.health_port()
        base = f"http://127.0.0.1:{port}"
        await sup.err.expect(r"restarting the worker group")  # a failure to report
        async with aiohttp.ClientSession() as session, \
                session.get(base + "/openapi.json") as resp:
            served = await resp.read()
        assert json.loads(served) == json.loads(load_openapi())
        schema = schemathesis.openapi.from_dict(json.loads(served))
        seen = await anyio.to_thread.run_sync(_run_schemathesis, schema, base, PHASES, 40)
        assert seen >= PHASES, seen
        assert sup.process.returncode is None  # it took all of that and is still up


PROBES = ("/healthz", "/readyz")
# answers that show the fuzzing met the daemon both running and restarting
PHASES = {("/readyz", 200), ("/readyz", 503), ("/status", 200)}


def _run_schemathesis(schema: Any, base_url: str, phases: set[tuple[str, int]],
                      rounds: int) -> set[tuple[str, int]]:
    """Every default check but ``not_a_server_error``: a probe's 503 is its documented
    answer while the group is not running; any other 5xx fails here. The operations take
    no parameters, so hypothesis has few distinct cases: passes over all of them meet the
    daemon in different phases, until every answer of ``phases`` was seen (at most
    ``rounds`` passes: a fixed 40 took longer than the test's timeout on a loaded
    machine). Returns the (path, status) pairs seen."""
    from schemathesis.checks import not_a_server_error

    seen: set[tuple[str, int]] = set()
    operations = [result.ok() for result in schema.get_all_operations()]
    for n in range(rounds * len(operations)):
        if n % len(operations) == 0 and n and phases <= seen:
            break
        operation = operations[n % len(operations)]

        @settings(max_examples=15, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def check(case: Any) -> None:
            response = case.call_and_validate(base_url=base_url,
                                              excluded_checks=[not_a_server_error])
            seen.add((case.operation.path, response.status_code))
            documented = response.status_code == 503 and case.operation.path in PROBES
            assert response.status_code < 500 or documented, (case.operation.path,
                                                               response.status_code)

        check()
    return seen
