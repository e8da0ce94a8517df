"""``elastic-supervisor status [--url URL] [--json] [--timeout S]``: show a supervisor's status.

Fetches ``/status`` from a running supervisor's health endpoint and prints it as a short
readable summary with a table of workers, or as the raw JSON document.

``elastic-supervisor status --rdzv-endpoint E --rdzv-id JOB [--rdzv-conf ...] [--json]``
shows the whole job instead: one row per node (waiting to join included), read from the
summaries every supervisor keeps in etcd (``rendezvous.summary``), without reaching any
node's HTTP port. ``--rdzv-conf`` takes the TLS and auth keys of ``run``.

Every value shown passes ``core.untrusted.sanitise`` first: the document comes from
whatever answers at the URL, and the job view from what any node wrote to etcd.

Exit codes: 0 shown, 1 the supervisor (or etcd) could not be reached or answered
nonsense, 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from supervisor.core.untrusted import as_dict, as_list, clean, sanitise, text

if TYPE_CHECKING:
    from supervisor.rendezvous.etcd.config import EtcdRendezvousConfig

DEFAULT_URL = "http://127.0.0.1:29480"
DEFAULT_TIMEOUT = 5.0
MAX_BODY = 1 << 20  # a status document is a few KiB; refuse to slurp anything huge
EXIT_OK = 0
EXIT_UNREACHABLE = 1
EXIT_USAGE = 2
PROG = "elastic-supervisor status"
MAX_ROWS = 10_000  # nodes shown by the job-wide view
MAX_CELL = 60  # characters of one cell of its table
MAX_SHOWN = 200  # characters of a URL or an error shown in a message


class StatusError(Exception):
    """The status could not be fetched or was not a status document."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def main_status(argv: list[str]) -> int:
    """Run the ``status`` subcommand; returns the process exit code."""
    try:
        ns = _build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error already printed by argparse
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if ns.rdzv_endpoint or ns.rdzv_id:
        return _job_status(ns)
    if ns.url is None:
        chosen = _discovered_url()
        if chosen is None:
            return EXIT_USAGE
        ns.url = chosen
    try:
        url = status_url(ns.url)
    except ValueError as exc:
        sys.stderr.write(f"{PROG}: error: {text(exc, MAX_SHOWN)}\n")
        return EXIT_USAGE
    try:
        doc = as_dict(sanitise(fetch_status(url, ns.timeout)))
    except StatusError as exc:
        # the default URL is a guess: the port may have moved (a busy default) or be another
        hint = (" (is a supervisor running here? its health port is in its log and STATUS "
                "line; pass --url http://HOST:PORT)") if ns.url == DEFAULT_URL else ""
        sys.stderr.write(f"{PROG}: {text(exc, MAX_SHOWN)}{hint}\n")
        return EXIT_UNREACHABLE
    if ns.json:  # json.dumps escapes every control character (ensure_ascii)
        sys.stdout.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    else:
        sys.stdout.write(clean(format_status(doc)))
    return EXIT_OK


def _discovered_url() -> str | None:
    """The one supervisor on this host (``supervisor.discovery``), else the default URL
    when none announced itself; None after listing several (the user picks one)."""
    from supervisor.discovery import find_supervisors

    found = find_supervisors()
    if len(found) == 1:
        return found[0].url
    if not found:
        return DEFAULT_URL
    listed = "".join(f"  --url {text(f.url, MAX_SHOWN)}   pid {f.pid}, run "
                     f"{text(f.run_id, MAX_SHOWN)}\n" for f in found)
    sys.stderr.write(f"{PROG}: {len(found)} supervisors run on this host; pick one:\n{listed}")
    return None


def _build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Show the status of a running elastic-supervisor.")
    p.add_argument(
        "--url", default=None,
        help="health endpoint base URL or full /status URL (default: the supervisor running "
             f"on this host; several: they are listed; none found: {DEFAULT_URL})",
    )
    p.add_argument("--json", action="store_true", help="print the raw JSON document")
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default="",
                   help="etcd endpoint(s): show every node of the job from etcd")
    p.add_argument("--rdzv-id", "--rdzv_id", default="", help="the job's run id (with etcd)")
    p.add_argument("--rdzv-conf", "--rdzv_conf", default="",
                   help="etcd TLS/auth keys as for run (cacert=,cert=,key=,user=,...)")
    p.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT,
        help=f"seconds to wait for an answer (default {DEFAULT_TIMEOUT:g})",
    )
    return p


def status_url(url: str) -> str:
    """``http://host:port`` or ``.../status``: the URL of the status document."""
    parts = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    path = parts.path if parts.path not in ("", "/") else "/status"
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def fetch_status(url: str, timeout: float) -> dict[str, Any]:
    """GET the status document, or raise ``StatusError`` with a one-line reason."""
    # the health endpoint is local or in-cluster: never route it through a proxy
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    try:
        with opener.open(request, timeout=timeout) as resp:
            body = resp.read(MAX_BODY + 1)
    except urllib.error.HTTPError as exc:
        raise StatusError(f"{url}: HTTP {exc.code} {exc.reason}") from None
    except urllib.error.URLError as exc:
        raise StatusError(f"cannot reach {url}: {exc.reason}") from None
    except (OSError, ValueError) as exc:  # timeouts, resets, bad ports
        raise StatusError(f"cannot reach {url}: {exc}") from None
    return _parse(url, body)


def _parse(url: str, body: bytes) -> dict[str, Any]:
    if len(body) > MAX_BODY:
        raise StatusError(f"{url}: answer larger than {MAX_BODY} bytes; not a status document")
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        raise StatusError(f"{url}: answer is not JSON; not a supervisor?") from None
    if not isinstance(doc, dict) or "state" not in doc or "run_id" not in doc:
        raise StatusError(f"{url}: answer is not a status document; not a supervisor?")
    return doc


# ---------------------------------------------------------------------------- the job


def _job_status(ns: argparse.Namespace) -> int:
    if not (ns.rdzv_endpoint and ns.rdzv_id):
        sys.stderr.write(f"{PROG}: error: --rdzv-endpoint and --rdzv-id go together\n")
        return EXIT_USAGE
    from supervisor.rendezvous.etcd.config import RendezvousConfigError, make_config

    try:
        config = make_config(endpoint=ns.rdzv_endpoint, run_id=ns.rdzv_id, nnodes="1",
                             rdzv_conf=ns.rdzv_conf)
    except RendezvousConfigError as exc:
        sys.stderr.write(f"{PROG}: error: {text(exc, MAX_SHOWN)}\n")
        return EXIT_USAGE
    try:
        found, skipped = _read_job(config, ns.timeout)
    except StatusError as exc:
        sys.stderr.write(f"{PROG}: {text(exc, MAX_SHOWN)}\n")
        return EXIT_UNREACHABLE
    rows = [as_dict(sanitise(row)) for row in found]
    now = time.time()
    if skipped:
        sys.stderr.write(f"{PROG}: skipped {skipped} malformed node summary(ies) in etcd\n")
    if len(rows) > MAX_ROWS:
        sys.stderr.write(f"{PROG}: showing the first {MAX_ROWS} of {len(rows)} nodes\n")
        rows = rows[:MAX_ROWS]
    if ns.json:
        from supervisor.rendezvous.etcd.summary import goodput_now

        for row in rows:
            row["goodput_now"] = goodput_now(row, now)
        # ensure_ascii: a sibling's control characters arrive escaped, never raw
        sys.stdout.write(json.dumps(rows, indent=2, sort_keys=True) + "\n")
    else:
        sys.stdout.write(clean(format_job(text(ns.rdzv_id, MAX_SHOWN), rows, now)))
    return EXIT_OK


def _read_job(config: EtcdRendezvousConfig, timeout: float
              ) -> tuple[list[dict[str, Any]], int]:
    import anyio

    from supervisor.rendezvous.etcd.summary import read_job
    from supervisor.rendezvous.etcd.wire.client import EtcdClient, EtcdError

    async def read() -> tuple[list[dict[str, Any]], int]:
        async with EtcdClient(config.endpoints, timeout=timeout, tls=config.tls,
                              user=config.user, password=config.password) as client:
            return await read_job(client, config.run_id)

    try:
        return anyio.run(read)
    except EtcdError as exc:
        raise StatusError(f"cannot read the job's status from etcd: {exc}") from None


_JOB_COLUMNS = ("NODE", "RANK", "HOST", "STATE", "ATTEMPT", "RESTARTS", "GOODPUT", "LOST",
                "LAST FAILURE", "HEALTH")


def format_job(run_id: str, rows: Sequence[dict[str, Any]], now_wall: float) -> str:
    """One row per node of the job, from the summaries in etcd."""
    from supervisor.rendezvous.etcd.summary import goodput_now

    if not rows:
        return f"job {run_id}: no node has published a status (not running, or not etcd)\n"
    table: list[tuple[str, ...]] = [_JOB_COLUMNS]
    for row in rows:
        g = goodput_now(row, now_wall)
        share = None if g is None else g["ratio"]
        ratio = ("-" if g is None else "unknown" if share is None else f"{100 * share:.1f}%")
        lost = "-" if g is None else _duration(g["lost"] if g["seen"] else "unknown")
        table.append(tuple(_cell(text) for text in (
            str(row.get("node_id")), _dash(row.get("node_rank")), str(row.get("host")),
            str(row.get("state")), _dash(row.get("attempt")),
            f"{row.get('restarts')}/{row.get('max_restarts')}", ratio, lost,
            str(row.get("last_failure") or "-"), _dash(row.get("health_url")),
        )))
    return f"job {run_id}: {len(rows)} node(s)\n" + "\n".join(_table(table)) + "\n"


# ---------------------------------------------------------------------------- format


def format_status(doc: dict[str, Any]) -> str:
    """A short human summary of a status document, ending with a worker table."""
    lines = _summary_lines(doc)
    workers = [as_dict(w) for w in as_list(doc.get("workers"))]
    if workers:
        lines.append("")
        lines.extend(_worker_table(workers))
    return "\n".join(lines) + "\n"


def _summary_lines(doc: dict[str, Any]) -> list[str]:
    restarts = as_dict(doc.get("restarts"))
    rdzv = as_dict(doc.get("rendezvous"))
    members = as_list(rdzv.get("members"))
    lines = [
        f"run         {doc.get('run_id')}  (role {doc.get('role')}, "
        f"version {doc.get('version')}, up {_duration(doc.get('uptime'))})",
        f"state       {doc.get('state')}  attempt {doc.get('attempt')}, restarts "
        f"{restarts.get('used')}/{restarts.get('max')} used, {restarts.get('left')} left",
        _node_line(doc, bool(members) or rdzv.get("backend") == "static"),
        f"rendezvous  {rdzv.get('backend')} round {rdzv.get('round')}, "
        f"{len(members)} member(s), took {_duration(rdzv.get('duration'))}",
    ]
    lines.extend(_waiting_lines(rdzv.get("etcd")))
    if doc.get("status"):
        lines.append(f"status      {doc['status']}")
    failure = as_dict(doc.get("last_failure"))
    if failure:
        lines.append(
            f"failure     attempt {failure.get('attempt')}: {failure.get('description')}"
        )
    if doc.get("exit_code") is not None:
        lines.append(f"exit code   {doc['exit_code']}")
    lines.extend(_readiness_lines(doc.get("readiness")))
    lines.extend(_goodput_lines(doc.get("goodput")))
    lines.extend(_health_lines(doc.get("node_health")))
    return lines


def _health_lines(health: object) -> list[str]:
    """Healing: this node's state (spare, failing its check, quarantined) and the job's
    quarantined nodes."""
    if not isinstance(health, dict):
        return []
    check = as_dict(health.get("last_check"))
    line = f"node health {health.get('node')}: {health.get('state')}"
    if health.get("reason"):
        line += f" ({health['reason']})"
    if check:
        line += f", last check {'passed' if check.get('ok') else 'failed'}"
    lines = [line]
    for held in as_list(as_dict(health.get("job")).get("quarantined")):
        held = as_dict(held)
        lines.append(f"quarantined {held.get('node')}: {held.get('reason')}")
    return lines


def _node_line(doc: dict[str, Any], in_round: bool) -> str:
    if not in_round:  # "node 0 of 0, world size 0" said nothing
        return f"node        not in a round yet ({doc.get('local_world_size')} local worker(s))"
    return (f"node        {doc.get('node_rank')} of {doc.get('group_world_size')}, "
            f"world size {doc.get('world_size')} ({doc.get('local_world_size')} local)")


def _waiting_lines(etcd: object) -> list[str]:
    """What the rendezvous waits for (``rendezvous.etcd.waitreport``), while it waits."""
    waiting = etcd.get("waiting") if isinstance(etcd, dict) else None
    if not isinstance(waiting, dict):
        return []
    since = waiting.get("since")
    text = f"waiting     for {waiting.get('what')}"
    if isinstance(since, int | float):
        text += f" since {time.strftime('%H:%M:%S', time.localtime(since))}"
        text += f" ({_duration(max(0.0, time.time() - since))})"
    if waiting.get("joined") is not None:
        text += f": {waiting.get('joined')} of {waiting.get('needed')} node(s) joined"
    if waiting.get("max_nodes") not in (None, waiting.get("needed")):
        text += f" (max {waiting.get('max_nodes')})"
    return [text]


def _readiness_lines(readiness: object) -> list[str]:
    if not isinstance(readiness, dict):
        return []
    waiting = as_list(readiness.get("awaiting_progress"))
    text = f"ready when  {readiness.get('ready_when')}"
    if waiting:
        text += ", waiting for progress from local rank(s) " + ", ".join(map(str, waiting))
    return [text]


def _goodput_lines(goodput: object) -> list[str]:
    """Totals, a table of time lost by cause, and the last failure's phases."""
    if not isinstance(goodput, dict):
        return []
    ratio = goodput.get("ratio")
    unknown = goodput.get("unknown")
    counts = f"{goodput.get('failures')} failure(s), {goodput.get('restarts')} restart(s)"
    if goodput.get("productive") == "unknown":  # no rank has shown progress yet
        return [f"goodput     unknown (no progress signal: see --progress-pattern) over "
                f"{_duration(goodput.get('wall'))} wall, idle {_duration(goodput.get('idle'))}"
                f"; {counts}", *_last_loss(goodput)]
    seen = not (isinstance(unknown, int | float) and unknown > 0)
    shown = ("unknown" if not seen or ratio == "unknown" else "-"
             if not isinstance(ratio, int | float) else f"{100 * ratio:.1f}%")
    lines = [
        f"goodput     {shown}"
        f" productive of {_duration(goodput.get('wall'))} wall: start-up "
        f"{_duration(goodput.get('startup'))}, productive {_duration(goodput.get('productive'))}"
        f", lost {_duration(goodput.get('lost'))}, idle {_duration(goodput.get('idle'))}"
        + ("" if seen else f", unknown {_duration(unknown)} (no progress signal)")
        + f"; {counts}",
    ]
    by_cause = goodput.get("lost_by_cause")
    lost = {k: v for k, v in by_cause.items() if v} if isinstance(by_cause, dict) else {}
    if lost:
        rows = [("CAUSE", "LOST"), *((k, _duration(v)) for k, v in sorted(lost.items()))]
        lines.append("")
        lines.extend(_table(rows))
    return lines + _last_loss(goodput)


def _last_loss(goodput: dict[str, Any]) -> list[str]:
    """The last failure's record: cause, outcome, phases."""
    lines: list[str] = []
    last = goodput.get("last_recovery")
    if isinstance(last, dict):
        given = last.get("phases")
        phases: dict[str, Any] = given if isinstance(given, dict) else {}
        steps = ", ".join(f"{k} {_duration(phases.get(k))}"
                          for k in ("detect", "stop", "relaunch", "resume"))
        lines.append(f"last loss   failure {last.get('number')} ({last.get('cause')}, attempt "
                     f"{last.get('attempt')}): {last.get('outcome')}, lost "
                     f"{_duration(last.get('lost'))} ({steps})")
    return lines


def _table(rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            for row in rows]


_COLUMNS = ("LOCAL", "RANK", "PID", "STATE", "EXIT", "PROGRESS")


def _worker_table(workers: Sequence[dict[str, Any]]) -> list[str]:
    return _table([_COLUMNS, *(_worker_row(w) for w in workers)])


def _worker_row(w: dict[str, Any]) -> tuple[str, ...]:
    if w.get("exit_code") is not None:
        exit_text = str(w["exit_code"])
    elif w.get("signal") is not None:
        exit_text = f"sig {w['signal']}"
    else:
        exit_text = "-"
    age = w.get("last_progress_age")
    progress = "-" if age is None else f"{_duration(age)} ago"
    return (
        str(w.get("local_rank")), str(w.get("global_rank")), _dash(w.get("pid")),
        str(w.get("state")), exit_text, progress,
    )


def _cell(value: str) -> str:
    return text(value, MAX_CELL)


def _dash(value: object) -> str:
    return "-" if value is None else str(value)


def _duration(seconds: object) -> str:
    if seconds == "unknown":  # a phase no progress signal let the supervisor see
        return "unknown"
    if not isinstance(seconds, int | float):
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"
