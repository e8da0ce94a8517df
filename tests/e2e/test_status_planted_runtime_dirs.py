"""``elastic-supervisor status`` without ``--url`` trusts only runtime directories and
announcements of the user running it, and shows whatever answers at the URL it found
through one sanitiser (issue 52, finding 5): a directory planted by ``nobody`` made root's
``status`` print raw terminal escapes and exit 2, show the planted document as the job,
and crash with ``OverflowError`` (``uptime`` 1e999) and ``AttributeError``
(``last_failure`` "boom").

Real processes: ``nobody`` plants its directory itself (``setpriv``), the command runs as
a subprocess, and the planted documents are served by a real HTTP server that counts who
asked.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
from aiohttp import web

from supervisor.discovery import ANNOUNCE, RUN_PREFIX, find_supervisors
from tests.support import deps
from tests.support.users import as_user

ESC = "\x1b"
# a status document as a hostile server sends it: every field of the wrong type, a number
# JSON cannot hold as a float, escapes in every string
HOSTILE = (
    b'{"run_id": "evil\\u001b]0;pwned\\u0007", "state": "running\\u001b[2J",'
    b' "uptime": 1e999, "attempt": 1e999, "last_failure": "boom", "restarts": [1],'
    b' "rendezvous": "x", "workers": ["w", {"local_rank": "\\u001b[31m", "pid": -1e999}],'
    b' "readiness": {"awaiting_progress": "abc"}, "goodput": {"wall": 1e999,'
    b' "lost_by_cause": {"\\u001b[1m": 1e308}, "last_recovery": {"phases": "x"}},'
    b' "node_health": {"node": "n\\u009b1m", "job": {"quarantined": ["x",'
    b' {"node": "\\u202eevil", "reason": "' + b"r" * 100_000 + b'"}]}}}'
)


@asynccontextmanager
async def hostile_server() -> AsyncIterator[tuple[str, list[str]]]:
    """An HTTP server answering every path with ``HOSTILE``; yields (URL, paths asked)."""
    asked: list[str] = []

    async def answer(request: web.Request) -> web.Response:
        asked.append(request.path)
        return web.Response(body=HOSTILE, content_type="application/json")

    app = web.Application()
    app.router.add_get("/{tail:.*}", answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", asked
    finally:
        await runner.cleanup()


def plant(tmp: Path, name: str, url: str, run_id: str, *, owner: str = "root",
          dir_mode: int = 0o700, file_owner: str | None = None) -> Path:
    """A runtime directory announcing a supervisor (this test's own, live pid) at ``url``."""
    where = tmp / f"{RUN_PREFIX}{name}"
    where.mkdir()
    (where / ANNOUNCE).write_text(json.dumps({"pid": os.getpid(), "url": url,
                                              "run_id": run_id}))
    (where / ANNOUNCE).chmod(0o600)
    who, file_who = pwd.getpwnam(owner), pwd.getpwnam(file_owner or owner)
    os.chown(where / ANNOUNCE, file_who.pw_uid, file_who.pw_gid)
    os.chown(where, who.pw_uid, who.pw_gid)
    where.chmod(dir_mode)
    return where


def shared_tmp(tmp_path: Path) -> Path:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    tmp.chmod(0o1777)  # like /tmp: anyone may make a directory there
    return tmp


async def status(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return await anyio.to_thread.run_sync(lambda: subprocess.run(
        [sys.executable, "-m", "supervisor", "status", "--timeout", "2", *args],
        env={**os.environ, "TMPDIR": str(tmp)}, capture_output=True, text=True, timeout=30))


def plant_as_nobody(tmp: Path, url: str, run_id: str) -> Path:
    """What ``nobody`` can do in a shared temp dir: make a directory that looks like a
    supervisor's, announcing a live pid (this test's) at ``url``; made by that user."""
    if os.geteuid() != 0:
        deps.missing("root, to drop to user nobody (run the tests as root, as .ci/run does)")
    deps.need_binary("setpriv", "apt-get install util-linux")
    where = tmp / f"{RUN_PREFIX}nobody"
    body = json.dumps({"pid": os.getpid(), "url": url, "run_id": run_id})
    script = 'umask 077 && mkdir "$1" && printf "%s" "$2" > "$1/health.json"'
    nobody = pwd.getpwnam("nobody").pw_uid  # by number: its group is not named alike
    subprocess.run([*as_user(str(nobody)), "/bin/sh", "-c", script, "plant", str(where), body],
                   check=True, timeout=30)
    assert where.stat().st_uid == nobody
    return where


async def test_a_directory_planted_by_another_user_is_never_read(tmp_path: Path) -> None:
    with tempfile.TemporaryDirectory(dir="/tmp") as shared:  # pytest's tmp is root's only
        tmp = Path(shared)
        tmp.chmod(0o1777)  # like /tmp: anyone may make a directory there
        async with hostile_server() as (url, asked):
            planted = plant_as_nobody(tmp, url, f"planted{ESC}[2J")
            assert find_supervisors([planted]) == []
            shown = await status(tmp)
    assert asked == []  # never fetched: what it names is never asked
    assert "planted" not in shown.stdout + shown.stderr
    assert ESC not in shown.stdout + shown.stderr
    assert "Traceback" not in shown.stderr


async def test_an_own_directory_or_file_that_others_can_write_is_never_read(
    tmp_path: Path,
) -> None:
    tmp = shared_tmp(tmp_path)
    async with hostile_server() as (url, asked):
        writable = plant(tmp, "group", url, "group", dir_mode=0o770)
        theirs = plant(tmp, "file", url, "file", file_owner="nobody")
        assert find_supervisors([writable, theirs]) == []
        await status(tmp)
    assert asked == []


async def test_a_hostile_document_at_an_own_directory_is_shown_without_crash_or_escape(
    tmp_path: Path,
) -> None:
    tmp = shared_tmp(tmp_path)
    async with hostile_server() as (url, asked):
        plant(tmp, "mine", url, "mine")
        shown = await status(tmp)
        as_json = await status(tmp, "--json")
    assert asked == ["/status", "/status"]
    assert shown.returncode == 0, shown.stderr
    assert "Traceback" not in shown.stderr + as_json.stderr
    for out in (shown.stdout, shown.stderr, as_json.stdout):
        assert ESC not in out and "\x07" not in out and "\x9b" not in out
        assert "\u202e" not in out
    assert "evil" in shown.stdout  # shown, made harmless
    assert len(shown.stdout) < 20_000  # the 100 KB reason is cut
    doc = json.loads(as_json.stdout)
    assert doc["uptime"] is None and doc["last_failure"] == "boom"


async def test_several_supervisors_are_listed_without_escapes(tmp_path: Path) -> None:
    tmp = shared_tmp(tmp_path)
    async with hostile_server() as (url, asked):
        plant(tmp, "one", url, f"one{ESC}]0;title\x07")
        plant(tmp, "two", url, "two\u202e")
        shown = await status(tmp)
    assert shown.returncode == 2  # the user picks one
    assert asked == []
    assert "one?]0;title?" in shown.stderr and "two?" in shown.stderr
    assert ESC not in shown.stderr and "\u202e" not in shown.stderr
