# The standby program. The spawner reads this file and runs its text, followed by the call
# ``_standby(PRELOAD_TEXT, PRELOAD_FILE)`` that hands it the child-side preload module
# (``childpreload``, which the fork server runs too), as
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


def _standby(preload_source: str, preload_file: str) -> None:
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
    explicit = [m for m in sys.argv[2].split(",") if m] if len(sys.argv) > 2 else []
    auto = sys.argv[3] if len(sys.argv) > 3 else None
    done = _thread.allocate_lock()
    failure: list[str] = []
    skipped: list[str] = []

    # the preload and the environment watch, shared with the fork server: a module object
    # of its own, never in sys.modules (programs.preload_source), run when it is needed
    preload = type(sys)("__elastic_preload__")
    preloading = bool(explicit or auto)

    def _load() -> None:
        exec(compile(preload_source, preload_file, "exec"), preload.__dict__)

    if preloading:
        _load()
        done.acquire()

        def _preload() -> None:
            try:
                try:  # never compete with the workers: run only when a CPU is idle
                    if os.sched_getscheduler(0) != os.SCHED_IDLE:  # not set (inherited) by us
                        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
                except (AttributeError, OSError):
                    pass
                reads: list[str] = []
                work = preload.Preload(reads)
                if work.explicit(explicit) and auto:
                    # modules an earlier worker of this rank imported from installed
                    # distributions; one that uses a per-attempt variable as it imports
                    # taints the standby
                    spec = preload.read_spec(auto)
                    restore = preload.watch_environ(spec["watch"], reads)
                    try:
                        work.auto(spec)
                    finally:
                        restore()
                work.check_cuda()
                skipped[:] = work.skipped
                top = work.tainted
                if top is not None:
                    failure.append(f"T{top}\t{work.error}")
                elif not work.ok:
                    failure.append(work.error)
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
    if preloading:
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
        if not preloading:
            _load()
        preload.start_recorder(record, argv)
    del go, fds, done, failure, skipped, explicit, auto, record, preload, _load
    del preloading, preload_source, preload_file
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


