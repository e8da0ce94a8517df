"""The health HTTP server over real sockets, plus its metrics and loop-lag sources."""

from __future__ import annotations

import functools
import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import anyio
import pytest
from anyio.from_thread import start_blocking_portal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from msgspec.structs import replace

from supervisor.core import state as sm
from supervisor.core.policy import RestartPolicy
from supervisor.health.looplag import LoopLag
from supervisor.health.metrics import Metrics
from supervisor.health.server import MAX_CONNECTIONS, load_openapi, serve_health
from tests.support.health import Harness, make_status_view, running_server
from tests.support.metrics import Samples, metric_samples

PATHS = ["/healthz", "/readyz", "/status", "/metrics", "/openapi.json"]




@dataclass
class FakeClock:
    now: float

    def __call__(self) -> float:
        return self.now






async def get_json(client: aiohttp.ClientSession, path: str) -> tuple[int, Any]:
    async with client.get(path) as resp:
        return resp.status, await resp.json()


# ------------------------------------------------------------------------ probes


async def test_started_reports_a_bound_port_that_accepts_connections() -> None:
    with anyio.fail_after(10):
        async with running_server(Harness()) as (_, port):
            assert port > 0
            stream = await anyio.connect_tcp("127.0.0.1", port)
            await stream.aclose()


async def test_port_is_released_after_cancellation() -> None:
    with anyio.fail_after(10):
        async with running_server(Harness()) as (_, port):
            pass
        with pytest.raises(OSError):
            await anyio.connect_tcp("127.0.0.1", port)


async def test_readyz_follows_the_phase() -> None:
    h = Harness(snapshot=make_status_view("starting"))
    with anyio.fail_after(10):
        async with running_server(h) as (client, _):
            seen = []
            for phase in ("starting", "running", "stopping", "running"):
                h.set_phase(phase)
                status, body = await get_json(client, "/readyz")
                seen.append((phase, status, body["ok"]))
            assert seen == [
                ("starting", 503, False),
                ("running", 200, True),
                ("stopping", 503, False),
                ("running", 200, True),
            ]


async def test_readyz_reason_names_the_phase() -> None:
    h = Harness(snapshot=make_status_view("backoff"))
    with anyio.fail_after(10):
        async with running_server(h) as (client, _):
            assert await get_json(client, "/readyz") == (
                503, {"ok": False, "reason": "not running: backoff"}
            )


async def test_healthz_fails_on_stale_progress_and_recovers_after_reset() -> None:
    h = Harness()
    with anyio.fail_after(10):
        async with running_server(h) as (client, _):
            h.progress.touch(1, time.monotonic())
            assert (await get_json(client, "/healthz"))[0] == 200
            h.progress.touch(1, time.monotonic() - 31.0)
            status, body = await get_json(client, "/healthz")
            assert status == 503
            assert "local rank 1" in body["reason"]
            assert (await get_json(client, "/readyz"))[0] == 503
            h.progress.reset(attempt=2)
            assert (await get_json(client, "/healthz"))[0] == 200


@pytest.mark.parametrize("phase", ["rendezvous", "exit_barrier", "backoff"])
async def test_healthz_stays_ok_while_waiting(phase: str) -> None:
    h = Harness(snapshot=make_status_view(phase))
    h.progress.touch(0, time.monotonic() - 1000.0)
    with anyio.fail_after(10):
        async with running_server(h) as (client, _):
            assert (await get_json(client, "/healthz"))[0] == 200


async def test_healthz_fails_on_loop_lag() -> None:
    h = Harness(lag=60.0)
    with anyio.fail_after(10):
        async with running_server(h) as (client, _):
            status, body = await get_json(client, "/healthz")
            assert status == 503
            assert "event loop lag" in body["reason"]


async def test_status_document_is_served() -> None:
    h = Harness()
    h.progress.touch(0, time.monotonic())
    with anyio.fail_after(10):
        async with running_server(h) as (client, _):
            status, body = await get_json(client, "/status")
            assert status == 200
            assert body["run_id"] == "job-7"
            assert body["state"] == "running"
            assert [w["pid"] for w in body["workers"]] == [4000, 4001]
            assert body["workers"][0]["last_progress_age"] is not None
            assert body["uptime"] >= 0


@pytest.mark.parametrize("path", PATHS)
async def test_head_answers_headers_without_body(path: str) -> None:
    with anyio.fail_after(10):
        async with running_server(Harness()) as (client, _), client.head(path) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"]
            assert await resp.read() == b""


async def test_unknown_path_is_404_json() -> None:
    with anyio.fail_after(10):
        async with running_server(Harness()) as (client, _):
            assert await get_json(client, "/nope") == (404, {"error": "Not Found", "status": 404})


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS"])
async def test_other_methods_are_405_with_allow(method: str) -> None:
    with anyio.fail_after(10):
        async with (
            running_server(Harness()) as (client, _),
            client.request(method, "/healthz") as resp,
        ):
            assert resp.status == 405
            assert set(resp.headers["Allow"].split(",")) == {"GET", "HEAD"}
            assert (await resp.json())["status"] == 405


async def test_server_header_hides_versions() -> None:
    with anyio.fail_after(10):
        async with running_server(Harness()) as (client, _), client.get("/healthz") as resp:
            assert resp.headers["Server"] == "elastic-supervisor"


async def test_malformed_request_gets_400_and_server_keeps_serving() -> None:
    with anyio.fail_after(10):
        async with running_server(Harness()) as (client, port):
            reply = await raw_exchange(port, b"\x00\xffNOT HTTP\r\n\r\n")
            assert reply.startswith(b"HTTP/1.") and b" 400 " in reply.split(b"\r\n")[0]
            assert (await get_json(client, "/healthz"))[0] == 200


async def test_malformed_requests_log_no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    # guards against one ERROR traceback per bad request from aiohttp's protocol logger
    with anyio.fail_after(10):
        async with running_server(Harness()) as (_, port):
            await raw_exchange(port, b"GET /healthz HTTP/9.9\r\n\r\n")
            await raw_exchange(port, b"GET /healthz HTTP/1.1\r\n\r\n")
    assert not [r for r in caplog.records if r.exc_info]


async def test_broken_snapshot_source_answers_500_json_and_keeps_serving(
    caplog: pytest.LogCaptureFixture,
) -> None:
    h = Harness(broken=True)
    with anyio.fail_after(10):
        async with running_server(h) as (client, _):
            assert await get_json(client, "/healthz") == (
                500, {"error": "internal error", "status": 500}
            )
            h.broken = False
            assert (await get_json(client, "/healthz"))[0] == 200
    assert any("health handler failed" in r.getMessage() for r in caplog.records)


async def raw_exchange(port: int, data: bytes) -> bytes:
    stream = await anyio.connect_tcp("127.0.0.1", port)
    async with stream:
        await stream.send(data)
        chunks = []
        try:
            while True:
                chunks.append(await stream.receive())
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            pass
    return b"".join(chunks)


# ----------------------------------------------------------------------- metrics






async def scrape(client: aiohttp.ClientSession) -> Samples:
    async with client.get("/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        return metric_samples(await resp.text())


async def test_metrics_parse_and_counters_move() -> None:
    h = Harness()
    with anyio.fail_after(10):
        async with running_server(h) as (client, _):
            first = await scrape(client)
            h.metrics.record_restart("exited")
            h.metrics.record_worker_exit("failed")
            h.metrics.deadline_expired("killed")
            h.metrics.request_rejected("unknown_pid")
            h.metrics.request_accepted()
            h.metrics.record_rendezvous(0.2)
            await get_json(client, "/healthz")
            second = await scrape(client)
    ns = "elastic_supervisor_"
    assert second[(ns + "restarts_total", (("reason", "exited"),))] == 1
    assert second[(ns + "worker_exits_total", (("outcome", "failed"),))] == 1
    assert second[(ns + "deadline_expirations_total", (("outcome", "killed"),))] == 1
    assert second[(ns + "watchdog_rejected_requests_total", (("reason", "unknown_pid"),))] == 1
    assert second[(ns + "watchdog_accepted_requests_total", ())] == 1
    assert second[(ns + "rendezvous_rounds_total", ())] == 1
    assert second[(ns + "rendezvous_duration_seconds_count", ())] == 1
    healthz = (ns + "http_requests_total", (("code", "200"), ("path", "/healthz")))
    assert healthz not in first
    assert second[healthz] == 1
    scrapes = (ns + "http_requests_total", (("code", "200"), ("path", "/metrics")))
    assert second[scrapes] == first.get(scrapes, 0) + 1


async def test_metrics_gauges_follow_the_snapshot() -> None:
    h = Harness()
    h.progress.touch(1, time.monotonic() - 5.0)
    with anyio.fail_after(10):
        async with running_server(h) as (client, _):
            running = await scrape(client)
            h.set_phase("backoff")
            h.progress.reset(attempt=2)
            backoff = await scrape(client)
    ns = "elastic_supervisor_"
    assert running[(ns + "state", (("elastic_supervisor_state", "running"),))] == 1
    assert running[(ns + "workers_up", ())] == 2
    assert running[(ns + "attempt", ())] == 1
    assert running[(ns + "last_progress_age_seconds", (("local_rank", "1"),))] >= 5.0
    assert backoff[(ns + "state", (("elastic_supervisor_state", "running"),))] == 0
    assert backoff[(ns + "state", (("elastic_supervisor_state", "backoff"),))] == 1
    assert not any(name == ns + "last_progress_age_seconds" for name, _ in backoff)


async def test_unknown_paths_share_one_metrics_label() -> None:
    h = Harness()
    with anyio.fail_after(10):
        async with running_server(h) as (client, _):
            for i in range(3):
                await get_json(client, f"/random-{i}")
            samples = await scrape(client)
    key = ("elastic_supervisor_http_requests_total", (("code", "404"), ("path", "other")))
    assert samples[key] == 3


def test_metrics_registries_are_private() -> None:
    a, b = Metrics(), Metrics()
    a.record_restart("exited")
    assert b"restarts_total{reason=\"exited\"} 1.0" in a.render()
    assert b"restarts_total{reason=\"exited\"} 0.0" in b.render()  # every reason at zero


def counter_value(m: Metrics, name: str, **labels: str) -> float:
    value = m.registry.get_sample_value(f"elastic_supervisor_{name}_total", labels or None)
    return 0.0 if value is None else value


def run_events(m: Metrics, clock: FakeClock, *steps: tuple[float, sm.Event]) -> sm.State:
    """Feed events through the pure state machine, telling ``m`` like the controller does."""
    state, policy = sm.State(), RestartPolicy(max_restarts=3)
    for at, event in steps:
        clock.now = at
        new, decision = sm.transition(state, event, policy)
        m.on_transition(state, new, event, decision)
        state = new
    return state


def test_observer_counts_a_failure_and_its_restart() -> None:
    clock = FakeClock(0.0)
    m = Metrics(clock=clock)
    state = run_events(
        m, clock,
        (2.0, sm.RendezvousComplete(1, 2)),
        (2.1, sm.GroupLaunched(1, frozenset({0, 1}), 2.1)),
        (5.0, sm.WorkerExited(1, 0, 10, 3, None, 5.0)),
        (5.1, sm.WorkerExited(1, 1, 11, None, 15, 5.1)),
        (5.2, sm.GroupStopped(5.2)),
        (5.3, sm.BackoffElapsed()),
        (5.8, sm.RendezvousComplete(2, 2)),
    )
    assert state.phase is sm.Phase.STARTING
    assert counter_value(m, "worker_exits", outcome="failed") == 1
    assert counter_value(m, "worker_exits", outcome="stopped") == 1
    assert counter_value(m, "failures", kind="exited") == 1
    assert counter_value(m, "restarts", reason="exited") == 1
    assert counter_value(m, "rendezvous_rounds") == 2
    total = m.registry.get_sample_value("elastic_supervisor_rendezvous_duration_seconds_sum")
    assert total == pytest.approx(2.0 + 0.5)


def test_observer_counts_signals_successes_and_membership_restarts() -> None:
    clock = FakeClock(0.0)
    m = Metrics(clock=clock)
    run_events(
        m, clock,
        (1.0, sm.RendezvousComplete(1, 3)),
        (1.0, sm.GroupLaunched(1, frozenset({0, 1, 2}), 1.0)),
        (2.0, sm.WorkerExited(1, 2, 12, 0, None, 2.0)),
        (3.0, sm.MembershipChanged("node joined")),
        (3.1, sm.WorkerExited(1, 0, 10, None, 15, 3.1)),
        (3.2, sm.GroupStopped(3.2)),
    )
    assert counter_value(m, "worker_exits", outcome="succeeded") == 1
    assert counter_value(m, "worker_exits", outcome="stopped") == 1
    assert counter_value(m, "restarts", reason="membership") == 1
    assert counter_value(m, "failures", kind="exited") == 0


def test_observer_counts_a_crash_by_signal() -> None:
    clock = FakeClock(0.0)
    m = Metrics(clock=clock)
    run_events(
        m, clock,
        (1.0, sm.RendezvousComplete(1, 1)),
        (1.0, sm.GroupLaunched(1, frozenset({0}), 1.0)),
        (2.0, sm.WorkerExited(1, 0, 10, None, 9, 2.0)),
    )
    assert counter_value(m, "worker_exits", outcome="signaled") == 1
    assert counter_value(m, "failures", kind="signaled") == 1


def test_metrics_ignore_unknown_phase() -> None:
    m = Metrics()
    snap = replace(make_status_view(), phase="weird")
    m.observe(snap, {}, time.monotonic(), 0.0)  # must not raise
    assert b"elastic_supervisor_workers_up 2.0" in m.render()


# ---------------------------------------------------------------------- loop lag


def test_loop_lag_records_overshoot() -> None:
    clock = FakeClock(100.0)
    lag = LoopLag(interval=0.5, clock=clock)
    assert lag.current() == 0.0
    assert lag.record(100.0, 100.75) == pytest.approx(0.25)
    clock.now = 100.75
    assert lag.current() == pytest.approx(0.25)


def test_loop_lag_grows_when_ticks_stop() -> None:
    clock = FakeClock(0.0)
    lag = LoopLag(interval=0.5, clock=clock)
    lag.record(0.0, 0.5)
    clock.now = 10.5
    assert lag.current() == pytest.approx(9.5)


def test_loop_lag_rejects_non_positive_interval() -> None:
    with pytest.raises(ValueError):
        LoopLag(interval=0)


async def test_loop_lag_task_measures_a_blocked_loop() -> None:
    lag = LoopLag(interval=0.01)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            # started() runs before the ticker's first sleep begins, so that sleep spans
            # the block below
            await tg.start(lag.run)
            time.sleep(0.2)  # block the event loop on purpose: this is the lag to measure
            measured = await lag.next_tick()
            tg.cancel_scope.cancel()
    assert measured >= 0.15


# ------------------------------------------------------------------------ OpenAPI


def openapi_document() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(load_openapi())
    return doc


def test_openapi_document_is_valid() -> None:
    validator = pytest.importorskip("openapi_spec_validator")
    validator.validate(openapi_document())


def test_openapi_document_covers_every_route() -> None:
    doc = openapi_document()
    assert doc["openapi"].startswith("3.")
    assert sorted(doc["paths"]) == sorted([*PATHS, "/leave-notice"])
    for path, item in doc["paths"].items():
        assert set(item) == ({"post"} if path == "/leave-notice" else {"get", "head"})


async def test_a_leave_notice_without_an_etcd_backend_is_refused_409() -> None:
    with anyio.fail_after(10):
        async with running_server(Harness()) as (client, _), \
                client.post("/leave-notice", json={"run_id": "r", "node": "n", "round": 0}
                            ) as resp:
            assert resp.status == 409
            assert (await resp.json())["accepted"] is False


async def test_a_leave_notice_whose_body_never_comes_is_answered_408() -> None:
    """The handler's connection is busy (never closed for room at the cap): a body that
    does not come must not hold it; without the bound this waits forever."""
    received: list[object] = []

    def sink(doc: object) -> tuple[int, dict[str, Any]]:
        received.append(doc)
        return 202, {"accepted": True}

    with anyio.fail_after(10):
        async with running_server(Harness(), notices=sink) as (_, port), \
                await anyio.connect_tcp("127.0.0.1", port) as stream:
            await stream.send(b"POST /leave-notice HTTP/1.1\r\nHost: x\r\n"
                              b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
            reply = b""
            while b"\r\n" not in reply:  # the status line (aiohttp lingers to close)
                reply += await stream.receive()
    assert b" 408 " in reply.split(b"\r\n")[0], reply[:200]
    assert received == []


@pytest.mark.parametrize(("body", "status"), [
    (b"{", 400), (b"[" * 1000, 400), (b"\xff\xfe", 400), (b"x" * 2000, 413)])
async def test_a_leave_notice_that_is_not_json_is_refused_and_never_reaches_the_sink(
        body: bytes, status: int) -> None:
    received: list[object] = []

    def sink(doc: object) -> tuple[int, dict[str, Any]]:
        received.append(doc)
        return 202, {"accepted": True}

    with anyio.fail_after(10):
        async with running_server(Harness(), notices=sink) as (client, _), \
                client.post("/leave-notice", data=body) as resp:
            assert resp.status == status
            assert (await resp.json())["status" if status == 413 else "accepted"] in (
                413, False)
        async with running_server(Harness(), notices=sink) as (client, _), \
                client.post("/leave-notice", json={"any": "thing"}) as resp:
            assert (resp.status, await resp.json()) == (202, {"accepted": True})
    assert received == [{"any": "thing"}]


async def test_openapi_document_is_served() -> None:
    with anyio.fail_after(10):
        async with running_server(Harness()) as (client, _):
            status, body = await get_json(client, "/openapi.json")
    assert status == 200
    assert body == openapi_document()


@pytest.mark.parametrize("phase", ["running", "failed"])
async def test_responses_match_openapi_schemas(phase: str) -> None:
    validators = pytest.importorskip("openapi_schema_validator")
    doc = openapi_document()
    h = Harness(snapshot=make_status_view(phase))
    h.progress.touch(0, time.monotonic())
    with anyio.fail_after(10):
        async with running_server(h) as (client, _):
            for path in ("/healthz", "/readyz", "/status"):
                status, body = await get_json(client, path)
                op = doc["paths"][path]["get"]["responses"][str(status)]
                schema = op["content"]["application/json"]["schema"]
                validators.validate(
                    body, {**schema, "components": doc["components"]},
                    cls=validators.OAS30Validator,
                )


# --------------------------------------------------- property-based clients (threaded)


@pytest.fixture(scope="module")
def threaded_server() -> Iterator[str]:
    """A server on its own event loop in a thread, for synchronous fuzzing clients."""
    h = Harness()
    with start_blocking_portal() as portal:
        future, (_, port) = portal.start_task(
            serve_health, "127.0.0.1", 0, h.current, h.progress, h.metrics, h.current_lag
        )
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            future.cancel()


TOKEN = st.text("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
                min_size=1, max_size=12)
PATH_CHARS = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=40)
SKIP_HEADERS = {"content-length", "transfer-encoding", "connection", "expect", "upgrade"}


@st.composite
def raw_requests(draw: st.DrawFn) -> bytes:
    """Well-framed HTTP/1.1 requests with arbitrary methods, paths, queries and headers."""
    method = draw(st.sampled_from(["GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS"]) | TOKEN)
    path = draw(st.sampled_from(PATHS) | PATH_CHARS.map(lambda p: "/" + p))
    headers = draw(st.lists(st.tuples(TOKEN, PATH_CHARS), max_size=5))
    lines = [f"{method} {path} HTTP/1.1", "Host: localhost", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in headers if k.lower() not in SKIP_HEADERS]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def garbage_requests() -> st.SearchStrategy[bytes]:
    """Arbitrary bytes, terminated so the parser sees a complete head.

    Blank lines alone are skipped: HTTP lets a server ignore empty lines before a
    request line, so the server rightly waits for more.
    """
    return st.binary(max_size=80).filter(
        lambda b: b"\r\n\r\n" not in b and b.strip(b"\r\n") != b""
    ).map(
        lambda b: b + b"\r\n\r\n"
    )


def exchange(url: str, data: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def status_of(reply: bytes) -> int:
    line = reply.split(b"\r\n", 1)[0]
    assert line.startswith(b"HTTP/1."), reply[:200]
    return int(line.split()[1])


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(request=raw_requests() | garbage_requests())
def test_fuzzed_requests_never_get_5xx(threaded_server: str, request: bytes) -> None:
    assert status_of(exchange(threaded_server, request)) < 500


def test_server_survives_fuzzing(threaded_server: str) -> None:
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    reply = exchange(threaded_server, request)
    assert status_of(reply) == 200


def test_schemathesis_finds_no_contract_violation(threaded_server: str) -> None:
    schemathesis = pytest.importorskip("schemathesis")
    schema = schemathesis.openapi.from_dict(openapi_document())
    for result in schema.get_all_operations():
        operation = result.ok()

        @settings(max_examples=5, deadline=None)
        @given(case=operation.as_strategy())
        def check(case: Any) -> None:
            case.call_and_validate(base_url=threaded_server)

        check()


# ------------------------------------------------------------------------ slow clients


async def test_slow_clients_are_closed_and_cannot_keep_probes_out() -> None:
    """Connections that never finish a request (slowloris) fill the connection cap; a probe
    still gets through (the oldest of them is closed for it), and after the request
    deadline they are all closed."""
    h = Harness()
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            _, port = await tg.start(functools.partial(
                serve_health, "127.0.0.1", 0, h.current, h.progress, h.metrics,
                h.current_lag, request_deadline=0.5))
            slow = []
            for _ in range(MAX_CONNECTIONS):
                stream = await anyio.connect_tcp("127.0.0.1", port)
                await stream.send(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # never finished
                slow.append(stream)
            # the cap is full: the oldest slow connection makes room, the probe is answered
            probe = await anyio.connect_tcp("127.0.0.1", port)
            await probe.send(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert (await probe.receive()).startswith(b"HTTP/1.1 200")
            await probe.aclose()
            for stream in slow:  # each is closed by the server (EOF), none answered
                with pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError)):
                    await stream.receive()
                await stream.aclose()
            async with (aiohttp.ClientSession() as client,
                        client.get(f"http://127.0.0.1:{port}/healthz") as resp):
                assert resp.status == 200
            tg.cancel_scope.cancel()
