"""Warm restarts: a pre-started interpreter per local rank, so a restarted worker skips
the interpreter's start-up (~10 ms of CPU, most of a restart's latency).

While a group runs, each local rank gets a *standby*: ``python -u -c STANDBY_CODE``
started exactly like a worker (own session, the parent-death wrapper, NUMA binding, the
supervisor's environment), which initialises the interpreter and blocks reading its stdin,
a Unix socket. When the next attempt starts the rank, the supervisor sends the worker's
command line and environment and passes its stdout/stderr descriptors (``SCM_RIGHTS``).
The standby then does what CPython's own ``main`` does for that command line:

- ``SCRIPT args``: ``sys.argv``, ``sys.path[0]`` (the script's real directory), and
  ``__main__`` with ``__file__`` (absolute), ``__loader__`` and ``__cached__`` as Python
  sets them, then runs the script's code in ``__main__``;
- ``-m MODULE args``: ``runpy._run_module_as_main``, which is what ``python -m`` calls;
- ``-c CODE args``: the code in ``__main__``.

The environment is replaced before any user code runs, stdin becomes ``/dev/null``,
``sys.orig_argv`` is the cold command line, and an uncaught exception prints the same
traceback (the standby's own frame is left out) and exits 1. What differs from a cold
start: ``/proc/PID/cmdline`` shows the standby command, and interpreter start-up options
read from the environment (``PYTHON*``, locale) come from the supervisor's environment,
which is what workers get anyway. ``--no-warm-restart`` turns it off.

Only a command of the forms above run by the standby's interpreter with ``-u`` (what
``worker_argv`` builds) is started warm; anything else, or a standby that died, falls back
to a cold spawn. Nothing here is on the first launch's path.
"""

from __future__ import annotations

import array
import contextlib
import logging
import marshal
import os
import signal
import socket
import time
from collections.abc import Sequence

from supervisor.core.envs import interpreter
from supervisor.workers.spawn import DeathSignal, Worker, WorkerSpec, spawn_worker

logger = logging.getLogger(__name__)

GO_TIMEOUT = 2.0  # seconds the go message may take to be accepted before a cold spawn
HEADER = 8  # bytes: big-endian length of the marshalled go message

# Runs as ``python -u -c STANDBY_CODE`` in ``__main__``. Everything lives in one function
# (locals only), since ``__main__``'s namespace is handed back clean to the user's code.
# Imports nothing beyond ``_socket`` (and ``runpy`` for ``-m``, which ``python -m`` also
# imports) so the user's code finds ``sys.modules`` as a cold interpreter leaves it.
STANDBY_CODE = r'''
def _standby():
    import _socket, marshal, os, sys
    main = sys.modules["__main__"].__dict__
    initial = {k: v for k, v in main.items() if k != "_standby"}
    sock = _socket.socket(fileno=0)
    data, fds, need = b"", [], None
    while need is None or len(data) < need:
        chunk, anc, _flags, _addr = sock.recvmsg(
            1 << 16, _socket.CMSG_SPACE(16), _socket.MSG_CMSG_CLOEXEC)
        for level, kind, raw in anc:
            if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
                fds += [int.from_bytes(raw[i:i + 4], sys.byteorder)
                        for i in range(0, len(raw) - 3, 4)]
        if not chunk:
            os._exit(0)  # the supervisor no longer needs us
        data += chunk
        if need is None and len(data) >= 8:
            need = 8 + int.from_bytes(data[:8], "big")
    go = marshal.loads(data[8:need])
    del data, chunk, anc
    sock.detach()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for target, fd in zip(go["fds"], fds):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(go["env"])
    sys.orig_argv[:] = go["orig_argv"]
    argv = go["argv"]
    del go, fds
    main.clear()
    main.update(initial)
    del initial
    try:
        if argv[0] == "-m":
            import runpy
            sys.argv[:] = ["-m", *argv[2:]]
            if not sys.flags.safe_path:  # -P / PYTHONSAFEPATH: Python prepends nothing
                sys.path[0] = os.getcwd()
            runpy._run_module_as_main(argv[1])
        else:
            if argv[0] == "-c":
                sys.argv[:] = ["-c", *argv[2:]]
                code = compile(argv[1], "<string>", "exec", dont_inherit=True)
            else:
                path = argv[0]
                full = path if os.path.isabs(path) else os.path.join(os.getcwd(), path)
                sys.argv[:] = argv
                if not sys.flags.safe_path:
                    sys.path[0] = os.path.dirname(os.path.realpath(path))
                try:
                    with open(full, "rb") as f:
                        source = f.read()
                except OSError as exc:
                    print(f"{sys.executable}: can't open file {full!r}: "
                          f"[Errno {exc.errno}] {exc.strerror}", file=sys.stderr)
                    sys.exit(2)
                loader = sys.modules["_frozen_importlib_external"].SourceFileLoader
                main.update(__file__=full, __cached__=None, __loader__=loader("__main__", full))
                code = compile(source, full, "exec", dont_inherit=True)
                del source, loader
            del argv
            exec(code, main)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:
        tb = exc.__traceback__
        tb = tb.tb_next if tb is not None else None  # the user's frames only
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        del exc, tb
        sys.exit(1)
_standby()
'''


class Standby:
    """One pre-started interpreter waiting for its worker's command line."""

    def __init__(self, process: Worker, sock: socket.socket, prefix: Sequence[str]) -> None:
        self.process = process  # a Worker whose spec is the standby's own command
        self.sock = sock
        self.prefix = list(prefix)  # interpreter and options: [python, "-u"]

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def local_rank(self) -> int:
        return self.process.local_rank

    @staticmethod
    def accepts(prefix: Sequence[str], argv: Sequence[str]) -> bool:
        """Whether a standby started with ``prefix`` runs ``argv`` as a cold start would."""
        n = len(prefix)
        if list(argv[:n]) != list(prefix) or len(argv) <= n:
            return False
        head = argv[n]
        if head in ("-m", "-c"):
            return len(argv) > n + 1
        # a source file: a directory or zip (run as a package) or a .pyc go cold
        return not head.startswith("-") and head.endswith(".py") and os.path.isfile(head)

    def go(self, spec: WorkerSpec) -> Worker | None:
        """Hand the worker over; None if the standby cannot take it (it is then gone)."""
        if self.process.poll_exit() is not None:
            logger.warning("standby for local rank %d exited before it was used (%s)",
                           self.local_rank, self.process.status)
            self.discard()
            return None
        targets = [n for n, fd in ((1, spec.stdout), (2, spec.stderr)) if fd is not None]
        fds = [fd for fd in (spec.stdout, spec.stderr) if fd is not None]
        body = marshal.dumps({
            "argv": list(spec.argv[len(self.prefix):]),
            "orig_argv": list(spec.argv),
            "env": dict(spec.env),
            "fds": targets,
        })
        message = len(body).to_bytes(HEADER, "big") + body
        try:
            self.sock.settimeout(GO_TIMEOUT)
            ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
            sent = self.sock.sendmsg([message], ancillary if fds else [])
            if sent < len(message):
                self.sock.sendall(message[sent:])
        except OSError as exc:  # includes the timeout
            logger.warning("standby for local rank %d did not take its worker: %s",
                           self.local_rank, exc)
            self.discard()
            return None
        self.sock.close()
        old = self.process
        return Worker(spec, old.popen, old.pidfd, time.monotonic(), time.time())

    def discard(self) -> None:
        """Kill and reap the standby (it never ran user code: nothing to wait for)."""
        self.sock.close()
        process = self.process
        if not process.reaped:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            process.reap()


def spawn_standby(
    local_rank: int,
    python: str,
    env: dict[str, str],
    death: DeathSignal,
    *,
    cwd: str | None = None,
    cpus: tuple[int, ...] | None = None,
) -> Standby:
    """Start the standby of one local rank. Raises OSError if it cannot be started."""
    prefix = interpreter(python)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        spec = WorkerSpec(local_rank, -1, [*prefix, "-c", STANDBY_CODE], env, cwd=cwd, cpus=cpus)
        process = spawn_worker(spec, death, stdin=theirs.fileno())
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return Standby(process, ours, prefix)


def is_standby_command(argv: Sequence[str]) -> bool:
    """Whether a process's command line is a standby's (for tools that list our children)."""
    return STANDBY_CODE in argv


def discard_all(standbys: dict[int, Standby]) -> list[int]:
    """Kill and reap every standby; returns their pids (to forget in the guardian)."""
    pids = []
    for standby in standbys.values():
        pids.append(standby.pid)
        standby.discard()
    standbys.clear()
    return pids

