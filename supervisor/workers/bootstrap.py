"""One rank of a Python-callable job: ``python -m supervisor.workers.bootstrap PAYLOAD RESULT
LOCAL_RANK``.

Runs in a fresh interpreter (spawn semantics). The payload, written by ``supervisor.api``,
is a pickle of plain data: the parent's ``sys.path``, where its ``__main__`` came from, and
the pickled ``(fn, args)``. The bootstrap restores the path, re-imports the parent's main
module as ``__mp_main__`` when the call refers to it (as ``multiprocessing``'s spawn does,
so a function defined in the launching script works; guard the script's own work with
``if __name__ == "__main__"``), substitutes ``${local_rank}`` in string arguments like
torchrun, calls ``fn(*args)`` and pickles the return value to RESULT (0600, written
atomically). An exception is written to ``TORCHELASTIC_ERROR_FILE`` in the format of torch's
``@record`` and the process exits 1, so the supervisor reports it as the root cause.

This module imports only the standard library: it is the first thing every rank runs.
"""

from __future__ import annotations

import json
import os
import pickle
import runpy
import sys
import time
import traceback
import types
from collections.abc import Callable, Sequence
from string import Template
from typing import Any

PAYLOAD_VERSION = 1
_importing_main = False  # True while the parent's main module is being re-imported


def importing_parent_main() -> bool:
    """True while this rank re-imports the launching script (a launch now would recurse)."""
    return _importing_main


def substitute(args: Sequence[Any], local_rank: int) -> list[Any]:
    """torchrun's ``macros.substitute``: ``${local_rank}`` in str arguments, others as is."""
    return [
        Template(a).safe_substitute(local_rank=str(local_rank)) if isinstance(a, str) else a
        for a in args
    ]


def load_call(payload_path: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """Read the payload, prepare the interpreter like the parent's, unpickle ``(fn, args)``."""
    with open(payload_path, "rb") as f:
        payload: dict[str, Any] = pickle.load(f)
    if payload.get("version") != PAYLOAD_VERSION:
        raise RuntimeError(f"payload version {payload.get('version')!r} is not supported")
    sys.path[:] = [p for p in payload["sys_path"] if isinstance(p, str)]
    if payload.get("main_name") or payload.get("main_path"):
        _import_parent_main(payload.get("main_name"), payload.get("main_path"))
    fn, args = pickle.loads(payload["call"])
    return fn, tuple(args)


def _import_parent_main(name: str | None, path: str | None) -> None:
    """Run the parent's main module as ``__mp_main__`` and make it ``__main__`` for pickle."""
    global _importing_main
    _importing_main = True
    try:
        if name:
            namespace = runpy.run_module(name, run_name="__mp_main__", alter_sys=True)
        else:
            assert path is not None
            namespace = runpy.run_path(path, run_name="__mp_main__")
    finally:
        _importing_main = False
    module = types.ModuleType("__mp_main__")
    module.__dict__.update(namespace)
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module


def write_result(path: str, value: Any) -> None:
    """Pickle ``value`` to ``path`` (0600) atomically: a reader sees all of it or nothing."""
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def error_record(exc: BaseException) -> dict[str, Any]:
    """The JSON torch's ``@record`` writes for an exception (``ErrorHandler.record_exception``)."""
    return {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(exc)),
                "timestamp": str(int(time.time())),
            },
        }
    }


def record_error(exc: BaseException) -> None:
    """Print the traceback like Python would and write the error file if one is expected."""
    traceback.print_exception(exc, file=sys.stderr)
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(error_record(exc), f)
    except OSError as err:
        print(f"bootstrap: cannot write error file {path}: {err}", file=sys.stderr)


def run(payload_path: str, result_path: str, local_rank: int) -> int:
    """Call the payload's function; return the process exit code."""
    try:
        fn, args = load_call(payload_path)
    except Exception as exc:
        record_error(exc)
        return 1
    try:
        value = fn(*substitute(args, local_rank))
    except Exception as exc:
        # the user's traceback starts in their function, not in this frame
        record_error(exc.with_traceback(exc.__traceback__.tb_next if exc.__traceback__ else None))
        return 1
    try:
        write_result(result_path, value)
    except Exception as exc:
        record_error(exc)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 3 or not args[2].isdigit():
        print("usage: python -m supervisor.workers.bootstrap PAYLOAD RESULT LOCAL_RANK",
              file=sys.stderr)
        return 2
    return run(args[0], args[1], int(args[2]))


if __name__ == "__main__":
    # run under the canonical name, so supervisor.api sees importing_parent_main()
    from supervisor.workers import bootstrap

    sys.exit(bootstrap.main())
