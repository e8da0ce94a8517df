"""The health HTTP server: ``/healthz /readyz /status /metrics /openapi.json``, read-only,
and ``POST /leave-notice``, a peer's hint that it left the round.

One aiohttp application run as one cooperating task on the supervisor's event loop.
Handlers only read: the current ``StatusView`` (published by the read model), the
``ProgressTable`` and the measured loop lag. They never await anything but a request's
own body, so a probe is answered in microseconds even while the controller is busy
stopping a group.

GET and HEAD only, but for the one POST. Unknown paths answer 404, other methods 405
with ``Allow``; every body is small JSON except ``/metrics``. A leave notice changes
nothing by itself: it is handed to the rendezvous (``rendezvous.leave_notice``), which
checks with the node it names before believing it; without an etcd backend it is refused.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

import anyio
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from anyio.abc import TaskStatus

from supervisor.core import health
from supervisor.core.statusview import ProgressTable, StatusView
from supervisor.health.connections import ConnectionLedger, cap_connections, pending_on
from supervisor.health.metrics import Metrics

logger = logging.getLogger(__name__)
http_logger = logging.getLogger(__name__ + ".http")
"""aiohttp's protocol errors go here (not to ``aiohttp.server``)."""

ViewSource = Callable[[], StatusView]
LagSource = Callable[[], float]
Clock = Callable[[], float]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
NoticeSink = Callable[[object], tuple[int, dict[str, Any]]]
"""Takes a leave notice's parsed JSON body; answers (HTTP status, JSON body)."""

CLEANUP_TIMEOUT = 5.0
SHUTDOWN_TIMEOUT = 1.0  # in-flight requests are tiny; do not hold a stop for them
MAX_REQUEST_BODY = 1024  # a leave notice is the only body ever read: ~100 bytes
BODY_DEADLINE = 2.0  # seconds a leave notice's body may take to arrive after its headers
# leave notices whose bodies are read at once: a real leave tells each peer once, so a few
# suffice; the rest are answered 503 at once instead of holding a connection for 2 s
MAX_NOTICE_BODIES = 4
CLIENT_GONE = 499  # counted for a request whose client went away (nginx's code); never sent
MAX_CONNECTIONS = 64  # probes and scrapers need a handful; the rest go to the workers
# seconds a connection has to deliver a complete request, from its opening or from its last
# response: a slow or silent client (slowloris) is closed, so it cannot hold one of the
# MAX_CONNECTIONS slots for long. Probes send their request at once; an idle keep-alive
# connection is closed after this too (aiohttp's keep-alive timer enforces both).
REQUEST_DEADLINE = 10.0
SERVER_NAME = "elastic-supervisor"
_COMMON_HEADERS = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"}


class _DropClientErrors(logging.Filter):
    """Drop tracebacks for malformed requests: aiohttp already answered them 400.

    A misbehaving prober must not fill the log with one traceback per request.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, HttpProcessingError)


http_logger.addFilter(_DropClientErrors())


class HealthApp:
    """The request handlers, bound to their read-only sources."""

    def __init__(
        self,
        views: ViewSource,
        progress: ProgressTable,
        metrics: Metrics,
        lag: LagSource,
        *,
        clock: Clock = time.monotonic,
        wall: Clock = time.time,
        max_loop_lag: float = health.DEFAULT_MAX_LOOP_LAG,
        notices: NoticeSink | None = None,
        ledger: ConnectionLedger | None = None,
    ) -> None:
        self._views = views
        self._notices = notices
        self._ledger = ledger if ledger is not None else ConnectionLedger(MAX_CONNECTIONS)
        self._bodies = 0  # leave notices whose bodies are being read
        self._progress = progress
        self._metrics = metrics
        self._lag = lag
        self._clock = clock
        self._wall = wall
        self._max_loop_lag = max_loop_lag
        self._openapi = load_openapi()

    async def healthz(self, request: web.Request) -> web.Response:
        """Liveness: 200 while not stuck, else 503."""
        verdict = health.liveness(
            self._views(), self._progress.view(), self._clock(), self._lag(),
            max_loop_lag=self._max_loop_lag,
        )
        return _verdict_response(verdict)

    async def readyz(self, request: web.Request) -> web.Response:
        """Readiness: 200 while the group runs healthy (and progresses), else 503."""
        verdict = health.ready_and_live(
            self._views(), self._progress.view(), self._clock(), self._lag(),
            max_loop_lag=self._max_loop_lag, shown=self._progress.shown(),
            expected=self._progress.expected,
        )
        return _verdict_response(verdict)

    async def status(self, request: web.Request) -> web.Response:
        """The status document."""
        doc = health.status_document(
            self._views(), self._progress.view(), self._clock(), now_wall=self._wall(),
            shown=self._progress.shown(), expected=self._progress.expected,
        )
        return _json_response(doc, 200)

    async def metrics(self, request: web.Request) -> web.Response:
        """Prometheus text; state gauges are refreshed from the status view first."""
        view, progress, now, lag = (
            self._views(), self._progress.view(), self._clock(), self._lag()
        )
        self._metrics.observe(view, progress, now, lag)
        self._metrics.observe_readiness(
            view, progress, now, lag, shown=self._progress.shown(),
            expected=self._progress.expected, max_loop_lag=self._max_loop_lag,
        )
        return web.Response(
            body=self._metrics.render(),
            headers={"Content-Type": self._metrics.content_type, **_COMMON_HEADERS},
        )

    async def leave_notice(self, request: web.Request) -> web.Response:
        """A peer says it left the round: handed to the rendezvous, which checks it."""
        if self._notices is None:
            return _json_response({"accepted": False, "reason": "this node's rendezvous "
                                   "backend takes no leave notices"}, 409)
        if self._bodies >= MAX_NOTICE_BODIES:
            busy = _json_response({"accepted": False, "reason": "too many notices at once"}, 503)
            busy.force_close()  # its body is never read
            return busy
        self._bodies += 1
        try:
            body = await self._read_body(request)
        finally:
            self._bodies -= 1
        if isinstance(body, web.Response):
            return body
        try:
            doc = json.loads(body)
        except (ValueError, RecursionError):
            return _json_response({"accepted": False, "reason": "the body is not JSON"}, 400)
        status, answer = self._notices(doc)
        return _json_response(answer, status)

    async def _read_body(self, request: web.Request) -> bytes | web.Response:
        """The body, or the answer when it does not come.

        While it is read the connection is *reading* in the ledger, the first closed for room
        at the cap: headers sent without a body must never keep a probe out.
        """
        if request.protocol.transport is None:  # closed before its handler ran
            return _gone()
        try:
            with self._ledger.reading_body(request.protocol), anyio.fail_after(BODY_DEADLINE):
                return await request.read()
        except TimeoutError:
            late = _json_response({"accepted": False,
                                   "reason": f"no complete body within {BODY_DEADLINE:g}s"}, 408)
            late.force_close()  # the rest of the body is never read: the connection goes
            return late
        except ConnectionError:
            return _gone()  # closed mid-body, by the client or for room at the cap

    async def openapi(self, request: web.Request) -> web.Response:
        """The OpenAPI document describing these endpoints."""
        return web.Response(
            body=self._openapi,
            headers={"Content-Type": "application/json", **_COMMON_HEADERS},
        )

    @web.middleware
    async def errors_and_counts(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Turn router errors into small JSON bodies and count every request."""
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            response = _error_response(exc)
        except Exception:
            # never let a bug in a reader take the server down: log it, answer 500
            logger.exception("health handler failed for %s %s", request.method, request.path)
            response = _json_response({"error": "internal error", "status": 500}, 500)
        self._metrics.record_http_request(request.path, response.status)
        return response


def make_app(
    views: ViewSource,
    progress: ProgressTable,
    metrics: Metrics,
    lag: LagSource,
    *,
    clock: Clock = time.monotonic,
    wall: Clock = time.time,
    max_loop_lag: float = health.DEFAULT_MAX_LOOP_LAG,
    notices: NoticeSink | None = None,
    ledger: ConnectionLedger | None = None,
) -> web.Application:
    """Build the aiohttp application (routes, middleware) without starting it.

    ``ledger`` is the one the server's connections are capped with (``cap_connections``):
    a leave notice's connection is marked in it while its body is read."""
    handlers = HealthApp(
        views, progress, metrics, lag, clock=clock, wall=wall, max_loop_lag=max_loop_lag,
        notices=notices, ledger=ledger,
    )
    app = web.Application(
        middlewares=[handlers.errors_and_counts], client_max_size=MAX_REQUEST_BODY
    )
    routes = {
        "/healthz": handlers.healthz,
        "/readyz": handlers.readyz,
        "/status": handlers.status,
        "/metrics": handlers.metrics,
        "/openapi.json": handlers.openapi,
    }
    for path, handler in routes.items():
        app.router.add_get(path, handler, allow_head=True)
    app.router.add_post("/leave-notice", handlers.leave_notice)
    app.on_response_prepare.append(_hide_server_version)
    return app


async def serve_health(
    host: str,
    port: int,
    views: ViewSource,
    progress: ProgressTable,
    metrics: Metrics,
    lag: LagSource,
    *,
    max_loop_lag: float = health.DEFAULT_MAX_LOOP_LAG,
    notices: NoticeSink | None = None,
    sock: socket.socket | None = None,
    request_deadline: float = REQUEST_DEADLINE,
    task_status: TaskStatus[tuple[str, int]] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the health endpoints until cancelled; started with the bound ``(host, port)``.

    ``port`` 0 picks a free port; the one bound is logged and passed to ``started``.
    ``sock``, if given, is an already bound and listening socket to serve instead.
    """
    ledger = ConnectionLedger(MAX_CONNECTIONS, pending_on)
    app = make_app(views, progress, metrics, lag, max_loop_lag=max_loop_lag,
                   notices=notices, ledger=ledger)
    runner = web.AppRunner(
        app,
        handle_signals=False,
        access_log=None,
        shutdown_timeout=SHUTDOWN_TIMEOUT,
        logger=http_logger,
        keepalive_timeout=request_deadline,
    )
    await runner.setup()
    assert runner.server is not None
    cap_connections(runner.server, ledger, metrics.record_http_eviction,
                    metrics.record_http_refusal)
    try:
        site: web.BaseSite = (
            web.SockSite(runner, sock) if sock is not None else web.TCPSite(runner, host, port)
        )
        await site.start()
        if sock is not None:
            host, port = sock.getsockname()[:2]
        bound = _bound_port(runner, port)
        logger.info("health server listening on http://%s:%d", host, bound)
        task_status.started((host, bound))
        await anyio.sleep_forever()
    finally:
        with anyio.move_on_after(CLEANUP_TIMEOUT, shield=True) as scope:
            await runner.cleanup()
        if scope.cancelled_caught:
            logger.warning("health server cleanup took over %.1f s; abandoned", CLEANUP_TIMEOUT)


def load_openapi() -> bytes:
    """The OpenAPI document shipped in this package, as bytes."""
    return resources.files("supervisor.health").joinpath("openapi.json").read_bytes()


def _bound_port(runner: web.AppRunner, requested: int) -> int:
    for address in runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            return int(address[1])
    return requested


async def _hide_server_version(request: web.Request, response: web.StreamResponse) -> None:
    # aiohttp would announce its and Python's exact versions to every prober
    response.headers["Server"] = SERVER_NAME


def _verdict_response(verdict: health.Verdict) -> web.Response:
    return _json_response(verdict.as_json(), 200 if verdict.ok else 503)


def _gone() -> web.Response:
    """What is counted for a request whose client went away: there is nobody to answer."""
    return _json_response({"accepted": False, "reason": "the client went away"}, CLIENT_GONE)


def _error_response(exc: web.HTTPException) -> web.Response:
    headers = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
    response = _json_response({"error": exc.reason, "status": exc.status}, exc.status)
    response.headers.update(headers)
    return response


def _json_response(body: dict[str, Any], status: int) -> web.Response:
    return web.Response(
        body=json.dumps(body, separators=(",", ":")).encode(),
        status=status,
        headers={"Content-Type": "application/json", **_COMMON_HEADERS},
    )
