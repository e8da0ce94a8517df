"""The real supervisor as a subprocess, with its output read line by line to wait on."""

from __future__ import annotations

import os
import re
import signal
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import anyio
from anyio.abc import Process


class Stream:
    """Lines read from one pipe, with a cursor so each expectation consumes what it saw."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.cursor = 0
        self.closed = False
        self.done = anyio.Event()
        self._changed = anyio.Event()

    def feed(self, line: str) -> None:
        self.lines.append(line)
        self._changed.set()
        self._changed = anyio.Event()

    def close(self) -> None:
        self.closed = True
        self._changed.set()
        self.done.set()

    async def expect(self, pattern: str, timeout: float = 15.0, *,
                     since: int | None = None) -> re.Match[str]:
        """The first line matching ``pattern`` after the last match (or from line
        ``since``, an earlier ``cursor``: for lines whose order is not fixed)."""
        regex = re.compile(pattern)
        if since is not None:
            self.cursor = since
        with anyio.fail_after(timeout):
            while True:
                while self.cursor < len(self.lines):
                    line = self.lines[self.cursor]
                    self.cursor += 1
                    m = regex.search(line)
                    if m:
                        return m
                if self.closed:
                    raise AssertionError(f"stream closed before {pattern!r}:\n" + self.text())
                await self._changed.wait()

    async def next_line(self) -> None:
        """Until one more line comes; raises if the stream has closed."""
        if self.closed:
            raise AssertionError("stream closed:\n" + self.text())
        await self._changed.wait()

    def text(self) -> str:
        return "\n".join(self.lines)


class Supervised:
    """A running supervisor process with its stdout (workers) and stderr (its log)."""

    def __init__(self, process: Process) -> None:
        self.process = process
        self.out = Stream()
        self.err = Stream()

    @property
    def pid(self) -> int:
        return self.process.pid

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    async def health_port(self, timeout: float = 15.0) -> int:
        """The port its log says the health endpoint listens on (bound, maybe not yet
        served: a request waits in the kernel's queue until it is)."""
        found = await self.err.expect(r"health endpoint on http://[^:]+:(\d+)", timeout)
        return int(found.group(1))

    async def serving(self, timeout: float = 15.0) -> int:
        """Wait until its health server answers (it starts after the first launch, its
        imports off the loop: the port is listening before that); return the port."""
        port = await self.health_port(timeout)
        client = aiohttp.ClientTimeout(total=timeout)
        async with (aiohttp.ClientSession(timeout=client) as session,
                    session.get(f"http://127.0.0.1:{port}/healthz") as response):
            await response.read()  # the kernel held the connection until it served
        return port

    async def wait(self, timeout: float = 30.0) -> int:
        with anyio.fail_after(timeout):
            code = await self.process.wait()
            await self.out.done.wait()  # the readers have drained the last lines
            await self.err.done.wait()
            return code


async def pump(stream: anyio.abc.ByteReceiveStream, sink: Stream) -> None:
    buf = b""
    try:
        async for chunk in stream:
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                sink.feed(line.decode(errors="replace"))
    except (anyio.ClosedResourceError, anyio.BrokenResourceError):
        pass
    if buf:
        sink.feed(buf.decode(errors="replace"))
    sink.close()


@asynccontextmanager
async def supervisor(
    args: Sequence[str],
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    launcher: Sequence[str] | None = None,
) -> AsyncIterator[Supervised]:
    """Start ``python -m supervisor run ARGS`` (or ``launcher`` + ARGS, e.g. through a
    ``setpriv`` that drops to another user); kill it (and wait) on the way out.

    systemd's variables are never inherited from the test's own environment; a test of
    sd_notify passes its own NOTIFY_SOCKET in ``env``.
    """
    full_env = {**os.environ}
    for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        full_env.pop(key, None)
    full_env.update(env or {})
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    head = [sys.executable, "-m", "supervisor", "run"] if launcher is None else launcher
    cmd = [*head, *args]
    process = await anyio.open_process(cmd, env=full_env, cwd=cwd)
    sup = Supervised(process)
    async with anyio.create_task_group() as tg:
        assert process.stdout is not None and process.stderr is not None
        tg.start_soon(pump, process.stdout, sup.out)
        tg.start_soon(pump, process.stderr, sup.err)
        try:
            yield sup
        except BaseException:
            # shown by pytest with the failure: what the supervisor and workers said
            print("--- supervisor stderr ---\n" + sup.err.text())
            print("--- workers' stdout ---\n" + sup.out.text())
            raise
        finally:
            with anyio.CancelScope(shield=True):
                if process.returncode is None:
                    process.send_signal(signal.SIGKILL)
                await process.wait()
                with anyio.move_on_after(5):
                    await sup.out.done.wait()
                    await sup.err.done.wait()
                tg.cancel_scope.cancel()
