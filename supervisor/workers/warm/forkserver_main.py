"""The fork server's program: import the preload list once, then fork ready standbys.

It is not imported by the supervisor: ``forkserver.py`` runs it as ``python -u -c
BOOTSTRAP``, where BOOTSTRAP drops the ``sys.path`` entry Python put first for ``-c``
(the working directory: nothing of ours may be shadowed by a user's file) and executes
this file in a namespace of its own, so ``__main__`` stays exactly as a cold interpreter
leaves it for the user's code. Until the preload, it uses only modules a cold start has
already imported (``os``, ``sys``, ``marshal``, ``_thread``) and ``_socket``.

Protocol (SOCK_SEQPACKET on fd 0, one marshalled dict per message):

1. The supervisor sends the configuration (``preload``, ``auto``, ``watch``, ``path0``,
   ``owner``). The server puts ``path0`` (the cold command's ``sys.path[0]``) in place,
   imports at the priority it was started with (a cold worker's: the import is one a
   worker would do, once per node, and is never starved on a busy node), with every use
   of a ``watch`` name through ``os.environ`` watched (``childpreload``), then checks that
   no thread is left (``/proc/self/task``) and that no device was initialised, and
   answers with its report.
2. A fork request carries each standby's environment and CPUs (``standbys``), with each
   standby's end of its socket pair as ``SCM_RIGHTS``. The server forks only from its main
   thread, only with no other thread, and double-forks: one intermediate child forks every
   standby of the request and exits, so each is reparented to the supervisor (a child
   subreaper), calls ``setsid``, tells the server its index and pid, sets its death
   signal once ``getppid()`` shows the supervisor, and then waits for its worker as a
   started standby does (``R`` on its socket, the same go message). The server answers
   with the pids by index.
3. EOF on fd 0: the server exits. The standbys it forked are not its children and live on.
"""

# No ``from __future__ import annotations``, ``typing`` or ``contextlib`` at run time
# (hence try/except/pass, not ``suppress``): a cold interpreter has imported none of them,
# and every import before the preload must be one already in ``sys.modules``.
# ruff: noqa: SIM105
import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from supervisor.workers.warm import childpreload as preload
else:
    Any = object  # what annotations evaluate to at run time

if __name__ == "__elastic_forkserver__" and not getattr(sys.flags, "safe_path", False):
    del sys.path[0]  # the working directory, which Python put first for ``-c``

PR_SET_PDEATHSIG = 1
SIGKILL = 9
THREAD_WAIT = 2.0  # seconds a thread the preload stopped may take to leave /proc/self/task
MAX_MESSAGE = 1 << 20
MAX_BATCH = 64  # standbys one request may ask for (descriptors in one message)


def _load_module(source: str, filename: str) -> "Any":
    """``source`` run in a module object of its own (not in ``sys.modules``)."""
    module = type(sys)("__elastic_preload__")
    exec(compile(source, filename, "exec"), module.__dict__)
    return module


if not TYPE_CHECKING and __name__ == "__elastic_forkserver__":
    # ``childpreload``'s text and file name, which ``forkserver.bootstrap_argv`` puts in
    # this program's namespace (``programs.preload_source``)
    preload = _load_module(*PRELOAD_SOURCE)  # noqa: F821


def _main() -> int | None:
    """Serve until EOF; in a forked standby, return its socket's descriptor instead."""
    import _socket
    import _thread
    import marshal

    ctl = _socket.socket(fileno=0)
    config = marshal.loads(ctl.recv(MAX_MESSAGE))
    report = _preload(config, _thread)
    prctl = _prctl() if report.get("ok") else None
    if prctl is None and report.get("ok"):
        report = {"ok": False, "error": "cannot load prctl from the C library"}
    library_fds = _open_fds()
    ctl.send(marshal.dumps(report))
    if not report.get("ok"):
        return None
    while True:
        data, fds = _receive(ctl, _socket)
        if not data:
            return None  # the supervisor closed its end: standbys live on without us
        try:
            request = marshal.loads(data)
            reply = _fork(request, fds, int(config["owner"]), prctl, library_fds, ctl)
        except Exception as exc:  # a bad request: answer it, keep serving
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        if "standby" in reply:  # we are the new standby: unwind to the top level
            return int(reply["standby"])
        for fd in fds:
            os.close(fd)
        ctl.send(marshal.dumps(reply))


def _receive(ctl: Any, _socket: Any) -> tuple[bytes, list[int]]:
    data, ancillary, _flags, _address = ctl.recvmsg(
        MAX_MESSAGE, _socket.CMSG_SPACE(4 * MAX_BATCH), _socket.MSG_CMSG_CLOEXEC)
    fds: list[int] = []
    for level, kind, raw in ancillary:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            fds += [int.from_bytes(raw[i:i + 4], sys.byteorder)
                    for i in range(0, len(raw) - 3, 4)]
    return data, fds


# ---------------------------------------------------------------------- preload
def _preload(config: "dict[str, Any]", _thread: "Any") -> "dict[str, Any]":
    """Import the preload list, then ``auto``'s names, watching per-attempt and per-rank
    names (``childpreload``); the report to send."""
    path0 = config.get("path0")
    if path0 is not None and not getattr(sys.flags, "safe_path", False):
        sys.path.insert(0, path0)  # what Python puts first for the cold command
    reads: list[str] = []
    work = preload.Preload(reads, track_threads=True)
    restore = preload.watch_environ(config.get("watch", ()), reads)
    try:
        if work.explicit(config.get("preload", ())) and config.get("auto"):
            work.auto(config["auto"])
    except BaseException as exc:
        work.fail(f"preloading failed: {type(exc).__name__}: {exc}")
    finally:
        restore()
    result: dict[str, Any] = {"ok": work.ok, "error": work.error, "tainted": work.tainted,
                              "skipped": work.skipped[:20]}
    if not _alone(THREAD_WAIT, _thread) and work.ok:
        culprit = work.threaded or "the preload"
        result.update(ok=False, threaded=culprit,
                      error=f"{culprit} left a thread running: cannot fork safely")
    if result["ok"]:
        work.check_cuda()
        result.update(ok=work.ok, error=work.error)
    if result["ok"] and "gc" in sys.modules:
        # what the preload made is shared with every standby: keep the collector from
        # writing to (and so copying) those pages in each of them
        sys.modules["gc"].freeze()
    return result


def _alone(timeout: float, _thread: "Any") -> bool:
    """Whether this process is down to its main thread.

    A thread the preload stopped may take a moment to leave ``/proc/self/task``. A
    thread a library stops by itself at every fork (OpenBLAS's pool, which
    numpy starts when it loads, and torch imports numpy: its ``pthread_atfork`` handler
    shuts the pool down, and the children start theirs when they need it) is not held
    against the preload: a child that exits at once runs those handlers, then we look
    again. Such a child touches nothing (``_exit`` only), so it is safe whatever the other
    thread holds."""
    if _wait_alone(timeout, _thread):
        return True
    probe = os.fork()
    if probe == 0:
        os._exit(0)
    os.waitpid(probe, 0)
    return _wait_alone(min(timeout, 0.5), _thread)


def _wait_alone(timeout: float, _thread: "Any") -> bool:
    pause = _thread.allocate_lock()
    pause.acquire()
    waited = 0.0
    while preload.thread_count() > 1:
        if waited >= timeout:
            return False
        pause.acquire(timeout=0.002)
        waited += 0.002
    return True


def _prctl() -> Any:
    """The C library's ``prctl`` (after the preload: torch has imported ctypes by then)."""
    try:
        return _libc().prctl
    except (ImportError, OSError, AttributeError):
        return None


def _libc() -> Any:
    """The C library, through ``ctypes`` (imported only after the preload)."""
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _open_fds() -> frozenset[int]:
    """Descriptors open after the preload, past the standard three: the preloaded
    libraries' own (kept in each standby: a library would break without them)."""
    try:
        listed = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        return frozenset()
    # not the listing's own descriptor, closed by now (its number is reused by the first
    # standby socket received: kept, it would leak into every later standby of a batch)
    return frozenset(fd for fd in listed if fd > 2 and _is_open(fd))


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


# ---------------------------------------------------------------------- fork
def _fork(request: dict[str, Any], fds: list[int], owner: int, prctl: Any,
          library_fds: frozenset[int], ctl: Any) -> dict[str, Any]:
    """Fork the request's standbys (one per descriptor) from one intermediate child; their
    pids in the request's order (fewer if a fork failed), or the error."""
    standbys = request.get("standbys")
    if not isinstance(standbys, list) or not standbys or len(fds) != len(standbys):
        return {"error": f"expected one descriptor per standby, got {len(fds)}"}
    if preload.thread_count() != 1:  # never fork a process that has another thread
        return {"error": f"the fork server has {preload.thread_count()} threads"}
    gate_r, gate_w = os.pipe()  # EOF once the intermediate child has exited
    pid_r, pid_w = os.pipe()
    middle = os.fork()
    if middle == 0:  # the intermediate child: fork the standbys, tell their pids, leave
        os.close(pid_r)
        middle = os.getpid()  # not the standbys' getppid(): we may be gone by then
        index, turn, done = _fork_each(len(standbys), gate_w)
        if index < 0:
            os._exit(0)
        _become_standby(standbys[index], fds[index], (index, pid_w), (middle, gate_r),
                        turn, done, owner, prctl, library_fds, ctl)
        return {"standby": fds[index]}
    os.close(gate_r)
    os.close(gate_w)
    os.close(pid_w)
    try:
        text = b""
        while chunk := os.read(pid_r, 4096):
            text += chunk
    finally:
        os.close(pid_r)
        os.waitpid(middle, 0)
    pids = {}
    for line in text.splitlines():  # "index pid", each written by the standby itself
        number, _, pid = line.partition(b" ")
        pids[int(number)] = int(pid)
    if not pids:
        return {"error": "the intermediate child did not fork"}
    return {"pids": pids}


def _fork_each(count: int, gate_w: int) -> tuple[int, int, int]:
    """In the intermediate child: fork ``count`` standbys one after another. One
    intermediate for the whole batch: each copy of the
    server's page tables costs milliseconds, so a standby costs one fork, not two and a
    teardown. Each standby sets itself up in turn, once the one before it has (the read
    end of a pipe whose write end that one closes, or loses when it dies): a batch of new
    processes that became runnable at once would queue ahead of the supervisor's loop.

    Returns, in standby ``i``: ``(i, the turn to wait for or -1, the turn to give)``;
    here: ``(-1, -1, -1)``, once every fork is done or one failed."""
    turn = -1
    for index in range(count):
        try:
            next_r, next_w = os.pipe()
        except OSError:
            break
        try:
            pid = os.fork()
        except OSError:
            os.close(next_r)
            os.close(next_w)
            break
        if pid == 0:
            os.close(gate_w)
            os.close(next_r)
            return index, turn, next_w
        os.close(next_w)
        if turn >= 0:
            os.close(turn)
        turn = next_r
    return -1, -1, -1


def _become_standby(request: dict[str, Any], sock_fd: int, tell: tuple[int, int],
                    parent: tuple[int, int], turn: int, done: int, owner: int, prctl: Any,
                    library_fds: frozenset[int], ctl: Any) -> None:
    """In the standby: own session, adopted by the supervisor, death signal, clean state.
    Exits (code 70) if any of it fails: the supervisor then sees a standby that died.

    The server learns our pid from us (``tell``: our index in the batch and the pipe),
    once we are in a session of our own: stopping the server (a kill of its process
    group) right after its answer must not reach a standby."""
    try:
        middle, gate = parent  # the intermediate child's pid; EOF once it has exited
        os.setsid()
        index, pid_w = tell
        os.write(pid_w, b"%d %d\n" % (index, os.getpid()))
        os.close(pid_w)
        for fd in (turn, gate):  # the one before us is set up; the intermediate is gone
            if fd >= 0:
                while os.read(fd, 64):
                    pass
                os.close(fd)
        _wait_reparented(middle)
        # the death signal is cleared by fork and would name the intermediate child:
        # set it once the supervisor is the parent, and check again (it may have died)
        if os.getppid() != owner:
            os._exit(70)
        prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0)
        if os.getppid() != owner:
            os._exit(70)
        ctl.detach()
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)  # the server's socket is not the standby's
        os.close(null)
        _close_fds(keep={1, 2, sock_fd, done} | library_fds)
        _apply_env(request.get("env", {}))
        cpus = request.get("cpus")
        if cpus:
            os.sched_setaffinity(0, cpus)
        _reseed()
        os.close(done)  # the next standby's turn
    except BaseException as exc:
        try:
            os.write(2, f"standby set-up failed: {type(exc).__name__}: {exc}\n".encode())
        finally:
            os._exit(70)


def _wait_reparented(middle: int) -> None:
    """The kernel closes an exiting process's files before it reparents its children:
    wait (bounded) until our parent is no longer the intermediate child."""
    import _thread

    pause = _thread.allocate_lock()
    pause.acquire()
    for _ in range(1000):
        if os.getppid() != middle:
            return
        pause.acquire(timeout=0.001)


def _close_fds(keep: set[int]) -> None:
    for fd in [int(name) for name in os.listdir("/proc/self/fd")]:
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass  # the listing's own descriptor, already closed


def _apply_env(env: dict[str, str]) -> None:
    """Make ``os.environ`` (and the C environment) exactly ``env``."""
    for name in [n for n in os.environ if n not in env]:
        del os.environ[name]
    for name, value in env.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


def _reseed() -> None:
    """Fresh random state, as a cold start has (``random`` reseeds itself at fork)."""
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        try:
            np_random.seed()  # the legacy global generator
        except Exception:
            pass
    torch = sys.modules.get("torch")
    generator = getattr(torch, "default_generator", None)
    if generator is not None:
        generator.seed()  # the CPU generator; CUDA's are seeded when CUDA starts


# ---------------------------------------------------------------------- hand-off
def _wait_and_run(sock_fd: int) -> None:
    """Report ready, wait for the go message, then become the worker (never returns)."""
    import _socket
    import marshal

    sock = _socket.socket(fileno=sock_fd)
    try:
        sock.send(b"R")
    except OSError:
        pass
    data, fds, need = b"", [], None
    while need is None or len(data) < need:
        try:
            chunk, ancillary, _flags, _address = sock.recvmsg(
                1 << 16, _socket.CMSG_SPACE(16), _socket.MSG_CMSG_CLOEXEC)
        except OSError:  # reset (our report was never read) as the supervisor ends
            os._exit(0)
        for level, kind, raw in ancillary:
            if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
                fds += [int.from_bytes(raw[i:i + 4], sys.byteorder)
                        for i in range(0, len(raw) - 3, 4)]
        if not chunk:
            os._exit(0)  # the supervisor no longer needs us
        data += chunk
        if need is None and len(data) >= 8:
            need = 8 + int.from_bytes(data[:8], "big")
    go = marshal.loads(data[8:need])
    sock.close()
    for target, fd in zip(go["fds"], fds, strict=False):
        os.dup2(fd, target)
        os.close(fd)
    store = go.get("await_store")
    if store:
        _await_store(*store)
    os.environ.update(go["env"])
    sys.orig_argv[:] = go["orig_argv"]
    if go.get("record"):
        preload.start_recorder(go["record"], go["argv"])
    _run_main(go["argv"])


def _await_store(host: str, port: int, limit: float) -> None:
    """Rank 0's store of this attempt: let the user's code dial only once it listens."""
    import _socket
    import time

    end = time.monotonic() + limit
    try:
        family, kind, proto, _name, address = _socket.getaddrinfo(
            host, port, 0, _socket.SOCK_STREAM)[0]
    except OSError:
        return
    while time.monotonic() < end:
        probe = _socket.socket(family, kind, proto)
        try:
            probe.settimeout(1.0)
            probe.connect(address)
            return
        except OSError:
            time.sleep(0.002)
        finally:
            probe.close()


def _run_main(argv: list[str]) -> None:
    """Do what CPython's ``main`` does for ``SCRIPT``, ``-m MODULE`` or ``-c CODE``."""
    main = sys.modules["__main__"].__dict__
    try:
        if argv[0] == "-m":
            import runpy

            sys.argv[:] = ["-m", *argv[2:]]
            if not getattr(sys.flags, "safe_path", False):
                _set_path0(os.getcwd())
            runpy._run_module_as_main(argv[1])  # type: ignore[attr-defined]
        else:
            code = _compile_main(argv, main)
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


def _compile_main(argv: list[str], main: dict[str, Any]) -> Any:
    if argv[0] == "-c":
        sys.argv[:] = ["-c", *argv[2:]]
        if not getattr(sys.flags, "safe_path", False):
            _set_path0("")
        return compile(argv[1], "<string>", "exec", dont_inherit=True)
    path = argv[0]
    full = path if os.path.isabs(path) else os.path.join(os.getcwd(), path)
    sys.argv[:] = argv
    if not getattr(sys.flags, "safe_path", False):
        _set_path0(os.path.dirname(os.path.realpath(path)))
    try:
        with open(full, "rb") as f:
            source = f.read()
    except OSError as exc:
        print(f"{sys.executable}: can't open file {full!r}: "
              f"[Errno {exc.errno}] {exc.strerror}", file=sys.stderr)
        sys.exit(2)
    loader = sys.modules["_frozen_importlib_external"].SourceFileLoader
    main.update(__file__=full, __cached__=None, __loader__=loader("__main__", full))
    return compile(source, full, "exec", dont_inherit=True)


def _set_path0(entry: str) -> None:
    """``sys.path[0]`` as the cold command has it: the preload put it there already."""
    if sys.path and sys.path[0] == entry:
        return
    sys.path.insert(0, entry)


if __name__ == "__elastic_forkserver__":
    # At the top level, so that the worker's SystemExit, exceptions and exit code reach
    # the interpreter as in a cold start (atexit hooks, flushing, the exit status).
    _standby_fd = _main()
    if _standby_fd is not None:
        _wait_and_run(_standby_fd)
