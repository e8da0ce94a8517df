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
   worker would do, once per node, and is never starved on a busy node), with every read
   of a ``watch`` name through ``os.environ`` watched, then checks that no thread is left
   (``/proc/self/task``) and that no device was initialised, and answers with its report.
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
else:
    Any = object  # what annotations evaluate to at run time

if __name__ == "__elastic_forkserver__" and not getattr(sys.flags, "safe_path", False):
    del sys.path[0]  # the working directory, which Python put first for ``-c``

TASKS = "/proc/self/task"
PR_SET_PDEATHSIG = 1
SIGKILL = 9
THREAD_WAIT = 2.0  # seconds a thread the preload stopped may take to leave /proc/self/task
MAX_MESSAGE = 1 << 20
MAX_BATCH = 64  # standbys one request may ask for (descriptors in one message)

# The site directories auto's modules must come from (the rule of ``autopreload``).
SITE_DIRS = ("/site-packages/", "/dist-packages/")


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
    """Import the preload list; the report to send."""
    path0 = config.get("path0")
    if path0 is not None and not getattr(sys.flags, "safe_path", False):
        sys.path.insert(0, path0)  # what Python puts first for the cold command
    try:
        result = _import_all(config)
    except BaseException as exc:
        result = {"ok": False, "error": f"preloading failed: {type(exc).__name__}: {exc}"}
    if not _alone(THREAD_WAIT, _thread) and result["ok"]:
        culprit = result.get("threaded") or "the preload"
        result.update(ok=False, threaded=culprit,
                      error=f"{culprit} left a thread running: cannot fork safely")
    else:
        result.pop("threaded", None)  # it stopped (or was stopped at the probe fork)
    if result["ok"]:
        torch = sys.modules.get("torch")
        cuda = getattr(torch, "cuda", None)
        if cuda is not None and cuda.is_initialized():
            result.update(ok=False, error="preloading initialised CUDA")
    if result["ok"] and "gc" in sys.modules:
        # what the preload made is shared with every standby: keep the collector from
        # writing to (and so copying) those pages in each of them
        sys.modules["gc"].freeze()
    return result


def _import_all(config: "dict[str, Any]") -> "dict[str, Any]":
    """Import ``preload``, then ``auto``'s names, watching per-attempt and per-rank reads;
    note the first module after whose import another thread ran (the suspect if one is
    left at the end)."""
    watch = frozenset(config.get("watch", ()))
    reads: list[str] = []
    restore = _watch_environ(watch, reads)
    result: dict[str, Any] = {"ok": True, "skipped": []}
    try:
        for name in config.get("preload", ()):
            try:
                __import__(name)
            except BaseException as exc:
                return {"ok": False,
                        "error": f"preloading {name!r} failed: {type(exc).__name__}: {exc}"}
            if not _checked(name, reads, result):
                return result
        auto = config.get("auto")
        if auto:
            _import_auto(auto, reads, result)
    finally:
        restore()
    result["skipped"] = result["skipped"][:20]
    return result


def _checked(name: str, reads: list[str], result: "dict[str, Any]") -> bool:
    """False (and ``result`` says why) if ``name`` read a watched name while importing."""
    if reads:
        result.update(ok=False, tainted=name.partition(".")[0],
                      error=f"{name!r} reads {reads[0]} while it imports")
        return False
    if "threaded" not in result and _thread_count() > 1:
        result["threaded"] = name
    return True


def _import_auto(auto: "dict[str, Any]", reads: list[str], result: "dict[str, Any]") -> None:
    """``--preload auto``: what a worker imported, from installed distributions only."""
    import importlib.metadata  # only auto needs it

    installed = importlib.metadata.packages_distributions()
    exclude = frozenset(auto.get("exclude", ()))
    skipped = result["skipped"]
    for name in auto.get("names", ()):
        top = name.partition(".")[0]
        if top not in installed or top in exclude or name in sys.modules:
            continue
        where = _origin(top)
        if where is None or not _installed_from(where, installed.get(top, ())):
            skipped.append(f"{name} (would come from {where or 'nowhere'}, "
                           f"not from its installed distribution)")
            continue
        try:
            __import__(name)
        except Exception as exc:  # a module made on the fly, or one that fails
            skipped.append(f"{name} ({type(exc).__name__}: {exc})")
            continue
        if not _checked(name, reads, result):
            return


def _origin(top: str) -> str | None:
    """Where the import system finds ``top`` with this ``sys.path`` (the cold one), or
    where it was already imported from; None if it finds no file."""
    module = sys.modules.get(top)
    where = getattr(module, "__file__", None) if module is not None else None
    if where is None:
        finder = sys.modules["_frozen_importlib_external"].PathFinder
        spec = finder.find_spec(top)
        if spec is None:
            return None
        where = spec.origin
        if where in (None, "namespace") and spec.submodule_search_locations:
            where = next(iter(spec.submodule_search_locations))
    return os.path.realpath(where) if isinstance(where, str) else None


def _installed_from(where: str, dists: "Any") -> bool:
    """Whether ``where`` lies where one of ``dists`` (distribution names) is installed,
    i.e. it is that distribution's file and not one of the user's that shadows it."""
    import importlib.metadata

    for dist_name in dists:
        try:
            base = os.path.realpath(str(importlib.metadata.distribution(dist_name)
                                        .locate_file("")))
        except Exception:  # metadata unreadable: not evidence for the file
            continue
        if where.startswith(os.path.join(base, "")):
            return True
    return False


def _in_site_dir(path: str) -> bool:
    return any(part in path for part in SITE_DIRS)


def _watch_environ(watch: frozenset[str], reads: list[str]) -> Any:
    """Record each lookup of a ``watch`` name through ``os.environ``, ``os.getenv``,
    ``os.environb`` or a copy made by ``os.environ.copy()``; returns the undo.

    A copy or an iteration alone looks up only the names that are present, and those
    are never watched ones (absent here), so neither taints."""
    if not watch:
        return lambda: None
    watch_b = frozenset(os.fsencode(n) for n in watch)

    def note(key: object) -> None:
        if key in watch or key in watch_b:
            reads.append(os.fsdecode(key) if isinstance(key, bytes) else str(key))

    class WatchedCopy(dict):  # type: ignore[type-arg]
        def __getitem__(self, key: Any) -> Any:
            note(key)
            return dict.__getitem__(self, key)

        def __contains__(self, key: object) -> bool:
            note(key)
            return dict.__contains__(self, key)

        def get(self, key: Any, default: Any = None) -> Any:
            note(key)
            return dict.get(self, key, default)

        def pop(self, key: Any, *default: Any) -> Any:
            note(key)
            return dict.pop(self, key, *default)

        def setdefault(self, key: Any, default: Any = None) -> Any:
            note(key)
            return dict.setdefault(self, key, default)

        def copy(self) -> "WatchedCopy":
            return WatchedCopy(self)

    base = type(os.environ)

    class Watched(base):  # type: ignore[valid-type,misc]
        def __getitem__(self, key: Any) -> Any:  # also get, getenv, pop, setdefault
            note(key)
            return base.__getitem__(self, key)

        def __contains__(self, key: object) -> bool:
            note(key)
            return base.__contains__(self, key)

        def copy(self) -> "WatchedCopy":
            return WatchedCopy(base.copy(self))

    targets = [os.environ, getattr(os, "environb", None)]
    for target in targets:
        if target is not None:
            target.__class__ = Watched

    def restore() -> None:
        for target in targets:
            if target is not None:
                target.__class__ = base

    return restore


def _thread_count() -> int:
    try:
        return len(os.listdir(TASKS))
    except OSError:
        return 1


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
    while _thread_count() > 1:
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
    if _thread_count() != 1:  # never fork a process that has another thread
        return {"error": f"the fork server has {_thread_count()} threads"}
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
        _start_recorder(go["record"], go["argv"])
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


def _start_recorder(out: str, argv: list[str]) -> None:
    """``--preload auto``: note what this worker imports, for the next fork server."""
    import _thread

    skip = os.path.join(os.path.realpath(
        os.getcwd() if argv[0] in ("-m", "-c") else os.path.dirname(argv[0])), "")

    def record() -> None:
        wait = _thread.allocate_lock()
        wait.acquire()
        for delay in (1, 4, 15, 40):
            wait.acquire(timeout=delay)
            names = []
            for name, module in list(sys.modules.items()):
                where = getattr(module, "__file__", None)
                if isinstance(where, str):
                    where = os.path.realpath(where)
                    if not where.startswith(skip) or _in_site_dir(where):
                        names.append(name)
            try:
                with open(out + ".tmp", "wb") as f:
                    f.write("\n".join(names).encode())
                os.replace(out + ".tmp", out)
            except OSError:
                return

    _thread.start_new_thread(record, ())


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
