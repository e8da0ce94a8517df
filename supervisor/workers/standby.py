"""Warm restarts: a pre-started interpreter per local rank, so a restarted worker skips
the interpreter's start-up and, with ``--preload``, the framework's import.

While a group runs, each local rank gets a *standby*: ``python -u -c STANDBY_CODE``
started exactly like a worker (own session, the parent-death wrapper, NUMA binding) and
with the environment its rank's next worker will get, less the variables that change per
attempt (``PER_ATTEMPT_ENV``). So ``sitecustomize``, ``.pth`` files and ``LD_PRELOAD``
constructors run in the rank's environment, as in a cold start. With ``--preload`` it then
imports the given modules in a thread at idle CPU priority (``SCHED_IDLE``: it never takes
a CPU from a runnable worker) and reports ``R`` (ready) or ``F`` and the error on its
socket. It blocks reading its stdin, a Unix socket. When the next attempt starts the rank,
the supervisor checks that the worker's environment equals the standby's apart from the
per-attempt variables (else a cold start), sends those variables and the command line and
passes stdout/stderr (``SCM_RIGHTS``). The standby applies the variables on top of its
``os.environ`` (what start-up set there survives) and does what CPython's own ``main``
does for that command line:

- ``SCRIPT args``: ``sys.argv``, ``sys.path[0]`` (the script's real directory), and
  ``__main__`` with ``__file__`` (absolute), ``__loader__`` and ``__cached__`` as Python
  sets them, then runs the script's code in ``__main__``;
- ``-m MODULE args``: ``runpy._run_module_as_main``, which is what ``python -m`` calls;
- ``-c CODE args``: the code in ``__main__``.

stdin becomes ``/dev/null`` (read-write, as ``subprocess.DEVNULL``), ``sys.orig_argv`` is
the cold command line, and an uncaught exception sets ``sys.last_*``, prints the same
traceback (the standby's own frame is left out) and exits 1. A worker handed over while its
standby is still preloading waits for the imports (it is ahead of a cold start, which would
import the same from the start); if they then fail, it ``execve``s the cold command line
with the cold environment in place (same pid: a cold start). What differs from a cold start
is listed in docs/torchrun-compat.md (``/proc/PID/cmdline`` and ``/proc/PID/environ`` show
the standby's, start time, and code that reads a per-attempt variable during interpreter
start-up sees it unset). ``--no-warm-restart`` turns it off.

Only a command of the forms above run by the standby's interpreter with ``-u`` (what
``worker_argv`` builds) is started warm; anything else, or a standby that died, falls back
to a cold spawn. Nothing here is on the first launch's path.
"""

from __future__ import annotations

import array
import contextlib
import functools
import logging
import marshal
import os
import signal
import socket
import time
from collections.abc import Mapping, Sequence

import anyio
import msgspec

from supervisor.core.envs import PER_ATTEMPT_ENV, interpreter
from supervisor.workers import autopreload
from supervisor.workers.spawn import DeathSignal, Worker, WorkerSpec, spawn_worker

logger = logging.getLogger(__name__)

GO_TIMEOUT = 2.0  # seconds the go message may take to be accepted before a cold spawn
HEADER = 8  # bytes: big-endian length of the marshalled go message

__all__ = ["PER_ATTEMPT_ENV", "Standby", "StandbyOptions", "discard_all", "env_mismatch",
           "is_standby_command", "spawn_standby", "standby_env"]

# Runs as ``python -u -c STANDBY_CODE [MODULE,...]`` in ``__main__``. Everything lives in
# one function (locals only), since ``__main__``'s namespace is handed back clean to the
# user's code. Without preloading it imports nothing beyond ``_socket`` and ``_thread``
# (and ``runpy`` for ``-m``, which ``python -m`` also imports) so the user's code finds
# ``sys.modules`` as a cold interpreter leaves it.
STANDBY_CODE = r'''
def _standby():
    import _socket, _thread, marshal, os, sys
    main = sys.modules["__main__"].__dict__
    initial = {k: v for k, v in main.items() if k != "_standby"}
    sock = _socket.socket(fileno=0)
    preload = [m for m in sys.argv[1].split(",") if m] if len(sys.argv) > 1 else []
    auto = sys.argv[2] if len(sys.argv) > 2 else None
    done = _thread.allocate_lock()
    failure, skipped = [], []
    def _auto(path):
        # modules an earlier worker of this rank imported from installed distributions;
        # one that reads a per-attempt variable while it imports taints the standby
        with open(path, "rb") as f:
            spec = marshal.loads(f.read())
        os.unlink(path)
        import importlib.metadata
        installed = importlib.metadata.packages_distributions()
        watch, reads = frozenset(spec["watch"]), []
        base = type(os.environ)
        class Watched(base):
            def __getitem__(self, key):
                if key in watch:
                    reads.append(key)
                return base.__getitem__(self, key)
        os.environ.__class__ = Watched
        try:
            for name in spec["names"]:
                top = name.partition(".")[0]
                if top not in installed or top in spec["exclude"] or name in sys.modules:
                    continue
                try:
                    __import__(name)
                except Exception as exc:  # a module made on the fly, or one that fails
                    skipped.append(f"{name} ({type(exc).__name__}: {exc})")
                if reads:
                    failure.append(f"T{top}\t{name!r} reads {reads[0]} while it imports")
                    return
        finally:
            os.environ.__class__ = base
    if preload or auto:
        done.acquire()
        def _preload():
            try:
                try:  # never compete with the workers: run only when a CPU is idle
                    if os.sched_getscheduler(0) != os.SCHED_IDLE:  # not set (inherited) by us
                        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
                except (AttributeError, OSError):
                    pass
                for name in preload:
                    try:
                        __import__(name)
                    except BaseException as exc:
                        failure.append(f"preloading {name!r} failed: "
                                       f"{type(exc).__name__}: {exc}")
                        return
                if auto:
                    _auto(auto)
                    if failure:
                        return
                torch = sys.modules.get("torch")
                cuda = getattr(torch, "cuda", None)
                if cuda is not None and cuda.is_initialized():
                    failure.append("preloading initialised CUDA")
            except BaseException as exc:
                failure.append(f"preloading failed: {type(exc).__name__}: {exc}")
            finally:
                try:
                    sock.send(b"F" + failure[0].encode() if failure
                              else b"R" + "; ".join(skipped[:5]).encode()[:4000])
                except OSError:
                    pass
                done.release()
        _thread.start_new_thread(_preload, ())
    else:  # started (the supervisor starts standbys one at a time); it may have
        try:  # handed us a worker and closed its end already
            sock.send(b"R")
        except OSError:
            pass
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
    if preload or auto:
        done.acquire()  # handed over while still importing: finish first (ahead of cold)
    sock.detach()
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.close(null)
    for target, fd in zip(go["fds"], fds):
        os.dup2(fd, target)
        os.close(fd)
    if failure:  # too late to tell the supervisor: become the cold worker, same pid
        os.execve(go["orig_argv"][0], go["orig_argv"], go["cold_env"])
    store = go.get("await_store")
    if store:  # rank 0's store of this attempt: dial only once it listens (see docstring)
        import time
        host, port, limit = store
        end = time.monotonic() + limit
        try:
            family, kind, proto, _name, addr = _socket.getaddrinfo(
                host, port, 0, _socket.SOCK_STREAM)[0]
        except OSError:
            end = 0
        while time.monotonic() < end:
            probe = _socket.socket(family, kind, proto)
            try:
                probe.settimeout(1.0)
                probe.connect(addr)
                break
            except OSError:
                time.sleep(0.002)
            finally:
                probe.close()
        del time, host, port, limit, end
    del store
    os.environ.update(go["env"])
    sys.orig_argv[:] = go["orig_argv"]
    argv = go["argv"]
    record = go.get("record")
    if record:  # --preload auto: note what this worker imports, for the next standby
        def _record(out, skip):
            wait = _thread.allocate_lock()
            wait.acquire()
            for delay in (1, 4, 15, 40):
                wait.acquire(timeout=delay)
                names = []
                for name, module in list(sys.modules.items()):
                    where = getattr(module, "__file__", None)
                    if isinstance(where, str):
                        where = os.path.realpath(where)
                        if not where.startswith(skip) or (
                                "/site-packages/" in where or "/dist-packages/" in where):
                            names.append(name)
                try:
                    with open(out + ".tmp", "wb") as f:
                        f.write("\n".join(names).encode())
                    os.replace(out + ".tmp", out)
                except OSError:
                    return
        skip = os.path.join(os.path.realpath(
            os.getcwd() if argv[0] in ("-m", "-c") else os.path.dirname(argv[0])), "")
        _thread.start_new_thread(_record, (record, skip))
        del skip
    del go, fds, done, failure, skipped, preload, auto, record
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
        exc = exc.with_traceback(tb)
        # what Python's own handler of an uncaught exception leaves for atexit hooks
        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, tb
        if sys.version_info >= (3, 12):
            sys.last_exc = exc
        sys.excepthook(type(exc), exc, tb)
        del exc, tb
        sys.exit(1)
_standby()
'''


class StandbyOptions(msgspec.Struct, frozen=True):
    """How standbys are prepared: modules to import before waiting (``--preload``)."""

    preload: tuple[str, ...] = ()
    auto: bool = False  # also what the rank's last worker imported (``--preload auto``)


def standby_env(worker_env: Mapping[str, str]) -> dict[str, str]:
    """A rank's worker environment less the variables that change per attempt."""
    return {k: v for k, v in worker_env.items() if k not in PER_ATTEMPT_ENV}


def env_mismatch(started: Mapping[str, str], worker_env: Mapping[str, str]) -> str | None:
    """The first variable (other than the per-attempt ones) a standby started with
    ``started`` would get wrong for ``worker_env``; None if there is none."""
    wanted = standby_env(worker_env)
    for name in sorted(started.keys() | wanted.keys()):
        if started.get(name) != wanted.get(name):
            return name
    return None


class Standby:
    """One pre-started interpreter waiting for its worker's command line."""

    def __init__(
        self,
        process: Worker,
        sock: socket.socket,
        prefix: Sequence[str],
        env: Mapping[str, str],
        preload: Sequence[str] = (),
        auto_spec: str | None = None,
    ) -> None:
        self.process = process  # a Worker whose spec is the standby's own command
        self.sock = sock
        self.prefix = list(prefix)  # interpreter and options: [python, "-u"]
        self.env = dict(env)  # what it was started with
        self.preload = tuple(preload)
        self.auto_spec = auto_spec  # the file with its auto list (it removes it)
        self.idle = False  # waiting at SCHED_IDLE (set back to normal at the hand-off)
        self._report: bytes | None = None  # b"R" or b"F..." once the preload reported

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

    @property
    def preloading(self) -> bool:
        return bool(self.preload) or self.auto_spec is not None

    def preloaded(self) -> bool | None:
        """True once the preload finished, False if it failed, None while it runs."""
        if not self.preloading:
            return True
        self._read_report()
        if self._report is None:
            return None
        return self._report.startswith(b"R")

    def preload_failure(self) -> str | None:
        """The preload's error, if it reported one (the standby is then of no use)."""
        if self.preloaded() is False:
            assert self._report is not None
            text = self._report[1:].decode(errors="replace") or "preloading failed"
            return text.partition("\t")[2] if text.startswith("T") else text
        return None

    @property
    def skipped(self) -> str:
        """Modules an auto preload could not import (a ready standby's report says)."""
        if self._report is None or not self._report.startswith(b"R"):
            return ""
        return self._report[1:].decode(errors="replace")

    def tainted(self) -> str | None:
        """The top-level package an auto preload found reading a per-attempt variable."""
        report = self._report if self.preloaded() is False else None
        if report is not None and report.startswith(b"FT"):  # "F", "T", package, tab, text
            return report[2:].decode(errors="replace").partition("\t")[0]
        return None

    def _read_report(self) -> None:
        if self._report is not None:
            return
        try:
            data = self.sock.recv(4096, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return  # still importing
        except OSError as exc:
            data = b"F" + str(exc).encode()
        self._report = data or b"Fthe standby exited"

    def go(
        self,
        spec: WorkerSpec,
        per_attempt: Mapping[str, str],
        await_store: tuple[str, int, float] | None = None,
        record: str | None = None,
    ) -> Worker | None:
        """Hand the worker over; None if the standby cannot take it (it is then gone).

        ``per_attempt``: the variables applied on top of the standby's environment; the
        caller has checked that the rest of ``spec.env`` equals what it started with.
        ``await_store``: (host, port, seconds): before the user's code runs, wait (at
        most that long) until rank 0's store of this attempt accepts connections.
        ``record``: where the worker records the modules it imports (``--preload auto``)."""
        if self.process.poll_exit() is not None:
            logger.warning("standby for local rank %d exited before it was used (%s)",
                           self.local_rank, self.process.status)
            self.discard()
            return None
        if self.idle and not _set_policy(self.pid, os.SCHED_OTHER, every_thread=True):
            logger.warning("standby for local rank %d: cannot restore its CPU priority",
                           self.local_rank)
            self.discard()
            return None
        targets = [n for n, fd in ((1, spec.stdout), (2, spec.stderr)) if fd is not None]
        fds = [fd for fd in (spec.stdout, spec.stderr) if fd is not None]
        body = marshal.dumps({
            "argv": list(spec.argv[len(self.prefix):]),
            "orig_argv": list(spec.argv),
            "env": dict(per_attempt),
            # used only if a preload still running then fails: the worker execs cold
            "cold_env": dict(spec.env) if self.preloaded() is None else {},
            "fds": targets,
            "await_store": list(await_store) if await_store else None,
            "record": record,
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
        self._close()
        old = self.process
        return Worker(spec, old.popen, old.pidfd, time.monotonic(), time.time())

    def _close(self) -> None:
        if self.sock.fileno() >= 0:
            with contextlib.suppress(RuntimeError):  # outside an event loop: nobody waits
                anyio.notify_closing(self.sock)  # wakes a task waiting for the preload report
        self.sock.close()

    def discard(self) -> None:
        """Kill and reap the standby (it never ran user code: nothing to wait for)."""
        self._close()
        autopreload.remove_spec(self.auto_spec)  # if it died before reading it
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
    options: StandbyOptions | None = None,
    auto_spec: str | None = None,
) -> Standby:
    """Start the standby of one local rank with ``env`` (see ``standby_env``).

    Raises OSError if it cannot be started."""
    options = options or StandbyOptions()
    prefix = interpreter(python)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    argv = [*prefix, "-c", STANDBY_CODE]
    if options.preload or auto_spec:
        argv.append(",".join(options.preload))
    if auto_spec:
        argv.append(auto_spec)
    try:
        spec = WorkerSpec(local_rank, -1, argv, env, cwd=cwd, cpus=cpus)
        process = spawn_worker(spec, death, stdin=theirs.fileno())
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    standby = Standby(process, ours, prefix, env, options.preload, auto_spec)
    # Where we may raise it back at the hand-off (CAP_SYS_NICE), the standby waits at idle
    # CPU priority: its start-up never takes a CPU from the workers or from our loop.
    standby.idle = _can_raise_priority() and _set_policy(process.pid, os.SCHED_IDLE)
    return standby


def _set_policy(pid: int, policy: int, *, every_thread: bool = False) -> bool:
    """Set ``pid``'s scheduling policy (one thread's: the main one); True if it was set.

    ``every_thread``: its other threads too, as far as they let us (at the hand-off, an
    import thread still running finishes at the worker's priority, not at idle)."""
    try:
        os.sched_setscheduler(pid, policy, os.sched_param(0))
    except OSError:
        return False
    if every_thread:
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                if int(tid) != pid:
                    with contextlib.suppress(OSError):  # it ended meanwhile
                        os.sched_setscheduler(int(tid), policy, os.sched_param(0))
    return True


@functools.cache
def _can_raise_priority() -> bool:
    """Whether we hold CAP_SYS_NICE (root usually), without which SCHED_IDLE is one-way."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> 23 & 1)
    except (OSError, ValueError):
        pass
    return False


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

