"""``elastic-supervisor status`` against a real health server (and a few non-servers)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import anyio
import pytest
from aiohttp import web

from supervisor.core.statusview import (
    FailureView,
    ProgressTable,
    RendezvousView,
    StatusView,
    WorkerView,
)
from supervisor.health.metrics import Metrics
from supervisor.health.server import serve_health
from supervisor.statuscmd import (
    EXIT_OK,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    format_status,
    main_status,
    status_url,
)


def make_status_view() -> StatusView:
    workers = (
        WorkerView(local_rank=0, global_rank=0, pid=4242, state="running", started_at=1.0),
        WorkerView(local_rank=1, global_rank=1, pid=None, state="failed", started_at=1.0,
                   exit_code=3),
    )
    failure = FailureView(
        kind="exited", attempt=1, local_rank=1, global_rank=1, pid=4243, exit_code=3,
        signal=None, message="", description="local rank 1 (pid 4243) exited with code 3",
        at_wall=time.time(),
    )
    return StatusView(
        run_id="job-status", phase="stopping", attempt=1, restart_count=0, max_restarts=2,
        restarts_left=2, world_size=2, local_world_size=2, role="trainer",
        published_at=time.monotonic(), started_at_wall=time.time() - 3725.0,
        workers=workers, last_failure=failure,
        rendezvous=RendezvousView("static", round=1, members=("n0",), last_duration=0.01),
    )


@asynccontextmanager
async def health_server() -> AsyncIterator[str]:
    snapshot = make_status_view()
    progress = ProgressTable()
    progress.touch(0, time.monotonic() - 2.0)
    async with anyio.create_task_group() as tg:
        _, port = await tg.start(
            serve_health, "127.0.0.1", 0, lambda: snapshot, progress, Metrics(), lambda: 0.0
        )
        yield f"http://127.0.0.1:{port}"
        tg.cancel_scope.cancel()


async def run_status(*argv: str) -> int:
    # urllib blocks: run the command in a thread so the server keeps serving
    return await anyio.to_thread.run_sync(main_status, list(argv))


@pytest.fixture
def refused_url() -> Iterator[str]:
    """A URL whose port is bound but not listening: connecting is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


async def test_prints_a_readable_summary_and_worker_table(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with anyio.fail_after(10):
        async with health_server() as url:
            code = await run_status("--url", url)
    out = capsys.readouterr().out
    assert code == EXIT_OK
    assert "job-status" in out
    assert "stopping" in out
    assert "restarts 0/2 used, 2 left" in out
    assert "up 1h02m" in out
    assert "took 10ms" in out
    assert "failure     attempt 1: local rank 1 (pid 4243) exited with code 3" in out
    header, row0, row1 = out.strip().splitlines()[-3:]
    assert header.split() == ["LOCAL", "RANK", "PID", "STATE", "EXIT", "PROGRESS"]
    assert row0.split()[:4] == ["0", "0", "4242", "running"]
    assert "ago" in row0
    assert row1.split()[:5] == ["1", "1", "-", "failed", "3"]


async def test_json_prints_the_document(capsys: pytest.CaptureFixture[str]) -> None:
    with anyio.fail_after(10):
        async with health_server() as url:
            code = await run_status("--url", url + "/status", "--json")
    assert code == EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    assert doc["run_id"] == "job-status"
    assert doc["workers"][0]["pid"] == 4242


async def test_unreachable_is_one_line_and_exit_1(
    refused_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with anyio.fail_after(10):
        code = await run_status("--url", refused_url, "--timeout", "2")
    err = capsys.readouterr().err
    assert code == EXIT_UNREACHABLE
    assert err.count("\n") == 1
    assert err.startswith("elastic-supervisor status: cannot reach")
    assert "Traceback" not in err


async def test_http_error_is_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    with anyio.fail_after(10):
        async with health_server() as url:
            code = await run_status("--url", url + "/nope")
    assert code == EXIT_UNREACHABLE
    assert "HTTP 404" in capsys.readouterr().err


@asynccontextmanager
async def plain_server(body: bytes, content_type: str) -> AsyncIterator[str]:
    """Something that is not a supervisor, answering every GET with ``body``."""

    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type=content_type)

    app = web.Application()
    app.router.add_get("/status", handler)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(
    ("body", "content_type"),
    [
        (b"<html>hi</html>", "text/html"),
        (b'{"hello": 1}', "application/json"),
        (b"[]", "text/plain"),
    ],
)
async def test_non_status_answer_is_exit_1(
    body: bytes, content_type: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with anyio.fail_after(10):
        async with plain_server(body, content_type) as url:
            code = await run_status("--url", url)
    assert code == EXIT_UNREACHABLE
    assert "not a supervisor" in capsys.readouterr().err


def test_bad_url_is_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main_status(["--url", "ftp://example/status"]) == EXIT_USAGE
    assert "not an http(s) URL" in capsys.readouterr().err


def test_unknown_flag_is_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main_status(["--bogus"]) == EXIT_USAGE
    assert "error" in capsys.readouterr().err


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main_status(["--help"]) == 0
    assert "--url" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("http://h:1", "http://h:1/status"),
        ("http://h:1/", "http://h:1/status"),
        ("h:1", "http://h:1/status"),
        ("http://h:1/status", "http://h:1/status"),
        ("https://h/x/status?a=1", "https://h/x/status?a=1"),
    ],
)
def test_status_url_normalisation(given: str, expected: str) -> None:
    assert status_url(given) == expected


def test_format_tolerates_a_minimal_document() -> None:
    text = format_status({"run_id": "r", "state": "rendezvous"})
    assert "rendezvous" in text
    assert "LOCAL" not in text
