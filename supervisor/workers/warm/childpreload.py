"""The preload and the environment watch, as the fork server and a spawned standby run them.

Child side: never imported by the supervisor. ``programs.preload_module`` hands its text to
both programs (``forkserver_main``, ``standby_main``), which run it in a module object of
their own that is not in ``sys.modules``: the user's code finds ``sys.modules`` and
``__main__`` as a cold interpreter leaves them. Hence, as in those programs, no ``from
__future__ import annotations``, ``typing`` or ``contextlib`` at run time, and no import
before the preload but of modules a cold start has already imported (``os``, ``sys``);
``importlib.metadata`` is imported only by ``--preload auto``.

``Preload`` imports the explicit ``--preload`` list, then ``auto``'s names (the rule is in
``autopreload``), and notes what went wrong. ``watch_environ`` records every use of a
watched name (the per-attempt variables, and under the fork server the per-rank ones)
through ``os.environ``, ``os.getenv``, ``os.environb`` or a copy of them, by any method
that looks a name up or changes it: a module that does so while it is preloaded taints
the import (its value would be the standby's, not its worker's).
"""

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from typing import Any
else:
    Any = object  # what annotations evaluate to at run time

TASKS = "/proc/self/task"
# The site directories auto's modules must come from (the rule of ``autopreload``).
SITE_DIRS = ("/site-packages/", "/dist-packages/")


class Preload:
    """One preload: what it imported, skipped, and why it failed if it did.

    ``track_threads``: note the first module after whose import another thread ran (the
    fork server's suspect if one is left; a standby imports in a thread of its own)."""

    def __init__(self, reads: "list[str]", track_threads: bool = False) -> None:
        self.reads = reads  # watched names looked up so far (``watch_environ`` appends)
        self.track_threads = track_threads
        self.ok = True
        self.error = ""
        self.tainted: str | None = None  # top-level package that used a watched name
        self.threaded: str | None = None
        self.skipped: list[str] = []  # auto's names it could not import, and why

    def explicit(self, names: "Iterable[str]") -> bool:
        """Import the ``--preload`` list; False (and why) if one failed or tainted."""
        for name in names:
            try:
                __import__(name)
            except BaseException as exc:
                self.fail(f"preloading {name!r} failed: {type(exc).__name__}: {exc}")
                return False
            if not self._checked(name):
                return False
        return True

    def auto(self, spec: "dict[str, Any]") -> bool:
        """``--preload auto``: what a worker imported, from installed distributions only
        (``spec``: ``names`` and the ``exclude``d packages); False if one tainted."""
        import importlib.metadata  # only auto needs it

        installed = importlib.metadata.packages_distributions()
        exclude = frozenset(spec.get("exclude", ()))
        for name in spec.get("names", ()):
            top = name.partition(".")[0]
            if top not in installed or top in exclude or name in sys.modules:
                continue
            where = origin(top)  # an installed name, but is it the installed file?
            if where is None or not installed_from(where, installed.get(top, ())):
                self.skipped.append(f"{name} (would come from {where or 'nowhere'}, "
                                    f"not from its installed distribution)")
                continue
            try:
                __import__(name)
            except Exception as exc:  # a module made on the fly, or one that fails
                self.skipped.append(f"{name} ({type(exc).__name__}: {exc})")
            if not self._checked(name):  # a failed import may have read one too
                return False
        return True

    def fail(self, error: str) -> None:
        self.ok, self.error = False, error

    def check_cuda(self) -> None:
        """Fail if the preload initialised CUDA (a forked or handed-over child cannot use it)."""
        torch = sys.modules.get("torch")
        cuda = getattr(torch, "cuda", None)
        if self.ok and cuda is not None and cuda.is_initialized():
            self.fail("preloading initialised CUDA")

    def _checked(self, name: str) -> bool:
        """False (and ``tainted`` says which) if ``name`` used a watched name as it imported."""
        if self.reads:
            self.tainted = name.partition(".")[0]
            self.fail(f"{name!r} reads {self.reads[0]} while it imports")
            return False
        if self.track_threads and self.threaded is None and thread_count() > 1:
            self.threaded = name
        return True


def origin(top: str) -> "str | None":
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


def installed_from(where: str, dists: "Iterable[str]") -> bool:
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


def read_spec(path: str) -> "dict[str, Any]":
    """A standby's auto list (``autopreload.write_spec``), read and removed."""
    import marshal

    with open(path, "rb") as f:
        spec: dict[str, Any] = marshal.loads(f.read())
    os.unlink(path)
    return spec


def watch_environ(watch: "Iterable[str]", reads: "list[str]") -> "Callable[[], None]":
    """Record in ``reads`` each use of a ``watch`` name through ``os.environ``,
    ``os.getenv``, ``os.environb`` or a copy made by their ``copy()``: every method that
    looks a name up or changes it (``[]``, ``in``, ``get``, ``pop``, ``setdefault``,
    assignment, ``del``, ``update``, ``|=``); returns the undo.

    A copy or an iteration alone looks up only the names that are present, and those
    are never watched ones (absent here), so neither taints."""
    names = frozenset(watch)
    if not names:
        return lambda: None
    names_b = frozenset(os.fsencode(n) for n in names)

    def note(key: object) -> None:
        if key in names or key in names_b:
            reads.append(os.fsdecode(key) if isinstance(key, bytes) else str(key))

    base = type(os.environ)
    watched = _watching(base, note)
    targets = [os.environ, getattr(os, "environb", None)]
    for target in targets:
        if target is not None:
            target.__class__ = watched

    def restore() -> None:
        for target in targets:
            if target is not None:
                target.__class__ = base

    return restore


def _watching(base: "type[Any]", note: "Callable[[object], None]") -> "type[Any]":
    """``base`` (``os.environ``'s class, or ``dict`` for a copy) with every method that
    takes a name noting it first."""

    class Watched(base):  # type: ignore[misc]
        def __getitem__(self, key: Any) -> Any:
            note(key)
            return base.__getitem__(self, key)

        def __contains__(self, key: object) -> bool:
            note(key)
            return bool(base.__contains__(self, key))

        def get(self, key: Any, default: Any = None) -> Any:
            note(key)
            return base.get(self, key, default)

        def pop(self, key: Any, *default: Any) -> Any:
            note(key)
            return base.pop(self, key, *default)

        def setdefault(self, key: Any, default: Any = None) -> Any:
            note(key)
            return base.setdefault(self, key, default)

        def __setitem__(self, key: Any, value: Any) -> None:
            note(key)
            base.__setitem__(self, key, value)

        def __delitem__(self, key: Any) -> None:
            note(key)
            base.__delitem__(self, key)

        def update(self, *args: Any, **kwargs: Any) -> None:
            other = dict(*args, **kwargs)
            for key in other:
                note(key)
            base.update(self, other)

        def __ior__(self, other: Any) -> Any:
            self.update(other)
            return self

        def copy(self) -> Any:
            return _watching(dict, note)(base.copy(self))

    return Watched


def thread_count() -> int:
    try:
        return len(os.listdir(TASKS))
    except OSError:
        return 1


def start_recorder(out: str, argv: "list[str]") -> None:
    """``--preload auto``: note what this worker imports (``autopreload``'s rule), 1, 5,
    20 and 60 s after its start, for its rank's next standby or the node's fork server."""
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
                    if not where.startswith(skip) or any(d in where for d in SITE_DIRS):
                        names.append(name)
            try:
                with open(out + ".tmp", "wb") as f:
                    f.write("\n".join(names).encode())
                os.replace(out + ".tmp", out)
            except OSError:
                return

    _thread.start_new_thread(record, ())
