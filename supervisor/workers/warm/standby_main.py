# The standby program. The spawner reads this file and runs its text as
# ``python -u -c TEXT [MODULE,...] [AUTO_SPEC]`` (standby.standby_code), so the standby
# gets exactly the sys.path and sys.modules a cold ``python -u`` start gets: nothing of
# the supervisor's package is imported, and ``-c`` puts the cwd first on sys.path as
# the cold command's own form then fixes up at the hand-off. See docs/design.md.
#
# It runs in ``__main__``. Everything lives in one function (locals only), since
# ``__main__``'s namespace is handed back clean to the user's code: no module docstring,
# no import or assignment at module level. Without preloading it imports nothing beyond
# ``_socket`` and ``_thread`` (and ``runpy`` for ``-m``, which ``python -m`` also
# imports) so the user's code finds ``sys.modules`` as a cold interpreter leaves it.
#
# Its one report on the socket (parsed by reports.parse; it cannot import that module):
# b"R" + modules it could not import, b"F" + error, or b"FT" + package + b"\t" + error
# (--preload auto: that package read a per-attempt variable while it imported).
#
# Lint: F821 because the closures' variables are deleted before the user's code runs
# (nothing of ours may stay reachable); SIM105 because contextlib is not imported here.
# ruff: noqa: F821, SIM105


def _standby() -> None:
    import sys

    # Our own imports must not find a user's file: drop the working directory that ``-c``
    # put first (``_socket`` is not built in). The cold command's entry (argv[1]: the
    # script's directory, the cwd for -m, "" for -c) goes first before anything of the
    # user's (a preload, the worker) is imported, so both find what a cold start finds.
    if not sys.flags.safe_path:
        del sys.path[0]
    import _socket
    import _thread
    import marshal
    import os

    main = sys.modules["__main__"].__dict__
    initial = {k: v for k, v in main.items() if k != "_standby"}
    sock = _socket.socket(fileno=0)
    if not sys.flags.safe_path:
        sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else "")
    preload = [m for m in sys.argv[2].split(",") if m] if len(sys.argv) > 2 else []
    auto = sys.argv[3] if len(sys.argv) > 3 else None
    done = _thread.allocate_lock()
    failure: list[str] = []
    skipped: list[str] = []

    def _auto(path: str) -> None:
        # modules an earlier worker of this rank imported from installed distributions;
        # one that reads a per-attempt variable while it imports taints the standby
        with open(path, "rb") as f:
            spec = marshal.loads(f.read())
        os.unlink(path)
        import importlib.metadata
        installed = importlib.metadata.packages_distributions()
        watch, reads = frozenset(spec["watch"]), []
        watch_b = frozenset(os.fsencode(n) for n in watch)

        def note(key: object) -> None:
            if key in watch or key in watch_b:
                reads.append(os.fsdecode(key) if isinstance(key, bytes) else str(key))

        class WatchedCopy(dict):  # type: ignore[type-arg]
            # os.environ.copy() while importing: its lookups count as reads too
            def __getitem__(self, key: object) -> object:
                note(key)
                return dict.__getitem__(self, key)

            def __contains__(self, key: object) -> bool:
                note(key)
                return dict.__contains__(self, key)

            def get(self, key: object, default: object = None) -> object:
                note(key)
                return dict.get(self, key, default)

            def copy(self) -> "WatchedCopy":
                return WatchedCopy(self)

        base = type(os.environ)

        class Watched(base):  # type: ignore[valid-type,misc]
            # os.environ[...], .get, os.getenv, `in`; a copy or an iteration looks up
            # only names that are present, never a per-attempt one (absent here)
            def __getitem__(self, key: str) -> str:
                note(key)
                return base.__getitem__(self, key)

            def __contains__(self, key: object) -> bool:
                note(key)
                return base.__contains__(self, key)

            def copy(self) -> "WatchedCopy":
                return WatchedCopy(base.copy(self))

        def origin(top: str) -> str | None:
            # the file the import system would take ``top`` from with this sys.path
            found = sys.modules["_frozen_importlib_external"].PathFinder.find_spec(top)
            if found is None:
                return None
            where = found.origin
            if where in (None, "namespace") and found.submodule_search_locations:
                where = next(iter(found.submodule_search_locations))
            return os.path.realpath(where) if isinstance(where, str) else None

        def installed_from(where: str, dists: list[str]) -> bool:
            # under the directory one of the distributions is installed in
            for dist_name in dists:
                try:
                    base = os.path.realpath(str(importlib.metadata.distribution(
                        dist_name).locate_file("")))
                except Exception:  # metadata unreadable: not evidence for the file
                    continue
                if where.startswith(os.path.join(base, "")):
                    return True
            return False

        environs = [os.environ, os.environb]
        for environ in environs:
            environ.__class__ = Watched
        try:
            for name in spec["names"]:
                top = name.partition(".")[0]
                if top not in installed or top in spec["exclude"] or name in sys.modules:
                    continue
                where = origin(top)  # an installed name, but is it the installed file?
                if where is None or not installed_from(where, installed.get(top, [])):
                    skipped.append(f"{name} (would come from {where}, not from its "
                                   f"installed distribution)")
                    continue
                try:
                    __import__(name)
                except Exception as exc:  # a module made on the fly, or one that fails
                    skipped.append(f"{name} ({type(exc).__name__}: {exc})")
                if reads:
                    failure.append(f"T{top}\t{name!r} reads {reads[0]} while it imports")
                    return
        finally:
            for environ in environs:
                environ.__class__ = base

    if preload or auto:
        done.acquire()

        def _preload() -> None:
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
        try:
            chunk, anc, _flags, _addr = sock.recvmsg(
                1 << 16, _socket.CMSG_SPACE(16), _socket.MSG_CMSG_CLOEXEC)
        except OSError:  # reset (our report was never read) as the supervisor ends
            os._exit(0)  # the same as its end closing: no user code ran, nothing to say
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
    for target, fd in zip(go["fds"], fds, strict=False):
        os.dup2(fd, target)
        os.close(fd)
    if failure:  # too late to tell the supervisor: become the cold worker, same pid
        os.execve(go["orig_argv"][0], go["orig_argv"], go["cold_env"])
    store = go.get("await_store")
    if store:  # rank 0's store of this attempt: dial only once it listens (see pool.py)
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
        def _record(out: str, skip: str) -> None:
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
            runpy._run_module_as_main(argv[1])  # type: ignore[attr-defined]
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
                    # Python's own message for a script it cannot open (this is the
                    # worker's process, not the supervisor's: stderr is the worker's)
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


if __name__ == "__main__":
    _standby()
