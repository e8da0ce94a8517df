"""The Python API: run a function or a command on this node's worker group.

``launch(config, entrypoint, *args)`` is torch's ``elastic_launch(config, entrypoint)(*args)``
for this supervisor, and ``alaunch`` is the same for async callers. Both run the whole
supervisor in-process (``supervise(..., embedded=True)``): rendezvous, restarts, the
watchdog and health behave exactly as for ``elastic-supervisor run``. Embedded, the
supervisor installs no signal handlers and adopts no orphans: the host process keeps its
own signals and children.

- A **callable** runs in a fresh interpreter per rank (spawn semantics, see
  ``supervisor.workers.bootstrap``); it and its arguments must be picklable (a top-level
  function). String arguments get ``${local_rank}`` substituted. On success the result is
  ``{global_rank: return value}`` for this node's ranks, read from the last attempt.
- A **command** (a ``str``) is an executable run with ``args`` as its arguments, like
  torch's binary entrypoints (``launch(cfg, sys.executable, "-u", "train.py")``); the
  result is ``{global_rank: None}``.
- If the group fails for good, ``WorkerGroupFailed`` (torch's ``ChildFailedError``) is
  raised with every failed rank of the last attempt, the root cause first, its message and
  traceback taken from the rank's error file.

``start_method``: ``spawn`` (default) and ``forkserver`` both start each rank as a fresh
interpreter (so ``forkserver`` behaves exactly like ``spawn``); ``fork`` is refused: forking
a process that runs an event loop and threads (the child watcher, gRPC clients, CUDA) can
deadlock or crash the child.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio
import msgspec

from supervisor.app import supervise
from supervisor.config import ConfigError, Settings, build
from supervisor.controller import CommandFor, settings_command
from supervisor.core.envs import interpreter
from supervisor.errors import RankFailure as RankFailure
from supervisor.errors import WorkerGroupFailed as WorkerGroupFailed
from supervisor.preflight import check_runnable
from supervisor.rendezvous.registry import check_backend
from supervisor.torchcompat import (
    child_failed_error,
    is_launch_config,
    launch_config_settings,
    unique_run_id,
)
from supervisor.views import RunResult
from supervisor.workers import bootstrap
from supervisor.workers.errorfile import read_error_file
from supervisor.workers.group import WorkerFailure
from supervisor.workers.topology import cpus_for

logger = logging.getLogger(__name__)

Entrypoint = Callable[..., Any] | str
Config = Settings | Mapping[str, Any]  # or torch's LaunchConfig (supervisor.torchcompat)
BOOTSTRAP = "supervisor.workers.bootstrap"


# ------------------------------------------------------------------------ settings


def launch_settings(config: Config, entrypoint: Entrypoint, args: Sequence[Any]) -> Settings:
    """Validate ``config`` (``Settings``, a mapping of settings or torch's ``LaunchConfig``)
    for this entrypoint. Without a run id the launch gets a unique one, as with torch's
    ``launch_agent`` (a ``Settings`` value's default ``none`` counts as none given)."""
    raw = config_settings(config)
    if not raw.get("rdzv_id") or (isinstance(config, Settings) and raw["rdzv_id"] == "none"):
        raw["rdzv_id"] = unique_run_id()
    if isinstance(entrypoint, str):
        what: dict[str, Any] = {
            "training_script": entrypoint, "training_script_args": [_arg(a) for a in args],
            "no_python": True, "module": False, "run_path": False,
        }
    elif callable(entrypoint):
        what = {"training_script": entrypoint_name(entrypoint), "training_script_args": []}
    else:
        raise TypeError(f"entrypoint must be a callable or a command string, got {entrypoint!r}")
    settings = build(raw, what)
    check_backend(settings)
    if callable(entrypoint) and settings.start_method == "fork":
        raise ConfigError(
            "start_method: 'fork' is not supported for Python callables: forking a process "
            "that runs an event loop and threads (child watcher, gRPC, CUDA) is unsafe; use "
            "'spawn' (default) or 'forkserver', both start a fresh interpreter per rank"
        )
    return settings


def config_settings(config: Config | Any) -> dict[str, Any]:
    """The raw settings of ``config``: ours as they are, torch's ``LaunchConfig`` converted."""
    if isinstance(config, Settings):
        return msgspec.structs.asdict(config)
    if is_launch_config(config):
        return launch_config_settings(config)
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be Settings, a mapping or torch's LaunchConfig, "
                        f"got {type(config).__name__}")
    return {str(k).replace("-", "_"): _value(str(k), v) for k, v in config.items()}


def entrypoint_name(entrypoint: Entrypoint) -> str:
    """torch's ``_get_entrypoint_name``: a function's name or the command itself."""
    if isinstance(entrypoint, str):
        return entrypoint
    module = getattr(entrypoint, "__module__", None)
    name = getattr(entrypoint, "__qualname__", None) or getattr(entrypoint, "__name__", "")
    return f"{module}.{name}" if module else str(name)


_TEXT_FIELDS = frozenset(k for k, t in Settings.__annotations__.items() if t == "str")


def _value(key: str, value: Any) -> Any:
    """``nproc_per_node=4`` means ``"4"``: numbers are fine where the flag takes text."""
    if key.replace("-", "_") in _TEXT_FIELDS and isinstance(value, int) and not isinstance(
            value, bool):
        return str(value)
    return value


def _arg(value: Any) -> str:
    return os.fspath(value) if isinstance(value, os.PathLike) else str(value)


# ------------------------------------------------------------------------ ranks


class RankDirs:
    """Remembers where each local rank of the latest attempt runs (wraps a CommandFor)."""

    def __init__(self, inner: CommandFor) -> None:
        self.inner = inner
        self.latest: dict[int, tuple[int, Path]] = {}  # local rank -> (global rank, rank dir)

    def command(self, local_rank: int, global_rank: int, rank_dir: Path) -> list[str]:
        self.latest[local_rank] = (global_rank, rank_dir)
        return self.inner(local_rank, global_rank, rank_dir)

    @property
    def attempt_dir(self) -> Path | None:
        dirs = [rank_dir.parent for _, rank_dir in self.latest.values()]
        return dirs[-1] if dirs else None

    def global_ranks(self) -> list[int]:
        return sorted(g for g, _ in self.latest.values())


class CallableJob:
    """A private directory (0700) with the payload and one result file per rank and attempt.

    Results live here rather than next to the logs: the parent unpickles them, so nobody
    else may be able to write them. The directory is removed on close.
    """

    def __init__(self, fn: Callable[..., Any], args: Sequence[Any], python: str) -> None:
        blob = _pickle_call(fn, args)
        self.dir = Path(tempfile.mkdtemp(prefix="elastic-supervisor-call-"))
        self.payload = self.dir / "payload.pkl"
        _write_private(self.payload, pickle.dumps(_payload(fn, blob)))
        self.python = python
        self.ranks = RankDirs(self._command)

    def __enter__(self) -> CallableJob:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def result_path(self, local_rank: int, rank_dir: Path) -> Path:
        return self.dir / rank_dir.parent.name / f"{local_rank}.result"

    def _command(self, local_rank: int, global_rank: int, rank_dir: Path) -> list[str]:
        result = self.result_path(local_rank, rank_dir)
        result.parent.mkdir(mode=0o700, exist_ok=True)
        return [*interpreter(self.python), "-m", BOOTSTRAP, str(self.payload), str(result),
                str(local_rank)]

    def results(self) -> dict[int, Any]:
        """``{global_rank: return value}`` of the latest attempt's ranks."""
        sys.modules.setdefault("__mp_main__", sys.modules["__main__"])  # as multiprocessing
        values: dict[int, Any] = {}
        for local_rank, (global_rank, rank_dir) in sorted(self.ranks.latest.items()):
            path = self.result_path(local_rank, rank_dir)
            try:
                values[global_rank] = pickle.loads(path.read_bytes())
            except FileNotFoundError:
                logger.warning("rank %d exited 0 without returning (sys.exit?): None",
                               global_rank)
                values[global_rank] = None
        return dict(sorted(values.items()))


def _pickle_call(fn: Callable[..., Any], args: Sequence[Any]) -> bytes:
    if getattr(fn, "__module__", None) == "__main__" and _main_origin() == (None, None):
        raise TypeError(
            f"{entrypoint_name(fn)} is defined in an interactive __main__ that a fresh "
            "interpreter cannot import; define it in a module or a script file"
        )
    try:
        return pickle.dumps((fn, tuple(args)), protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise TypeError(
            f"the entrypoint and its arguments must be picklable (a top-level function): {exc}"
        ) from exc


def _payload(fn: Callable[..., Any], blob: bytes) -> dict[str, Any]:
    # re-import the parent's __main__ in the child only when the call refers to it
    name, path = _main_origin() if b"__main__" in blob else (None, None)
    return {"version": bootstrap.PAYLOAD_VERSION, "sys_path": list(sys.path), "main_name": name,
            "main_path": path, "call": blob}


def _main_origin() -> tuple[str | None, str | None]:
    """(module name, file path) the parent's ``__main__`` can be re-imported from."""
    main = sys.modules.get("__main__")
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name:
        # like multiprocessing: a package's __main__ is never re-run in the child
        return (None, None) if name == "__main__" or name.endswith(".__main__") else (name, None)
    path = getattr(main, "__file__", None)
    return (None, os.path.abspath(path)) if path else (None, None)


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW,
                 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


# ------------------------------------------------------------------------ failure report


def group_failure(name: str, result: RunResult, ranks: RankDirs) -> WorkerGroupFailed:
    """Build the exception from the run's typed result and the last attempt's error files."""
    if not result.attempt_started or ranks.attempt_dir is None:
        return WorkerGroupFailed(
            name, {}, exit_code=result.exit_code,
            root_cause=f"no worker group was started (exit code {result.exit_code})")
    failures: dict[int, RankFailure] = {}
    for failure in result.failures:
        if failure.local_rank in ranks.latest:
            global_rank, rank_dir = ranks.latest[failure.local_rank]
            failures[global_rank] = _rank_failure(failure, global_rank, rank_dir)
    first = next(iter(failures.values()), None)
    return WorkerGroupFailed(name, failures, exit_code=result.exit_code,
                             root_cause=result.root_cause or (first.describe() if first else
                                                              f"exit code {result.exit_code}"))


def _rank_failure(failure: WorkerFailure, global_rank: int, rank_dir: Path) -> RankFailure:
    error_file = rank_dir / "error.json"
    report = read_error_file(error_file)
    return RankFailure(
        global_rank=global_rank, local_rank=failure.local_rank, pid=failure.pid,
        exit_code=failure.exit_code, signal=failure.signal,
        message=report.message.strip() if report else failure.message,
        traceback=report.traceback if report else "",
        error_file=str(error_file),
        timestamp=failure.at_wall,
    )


# ------------------------------------------------------------------------ entry points


async def alaunch(config: Config, entrypoint: Entrypoint, *args: Any) -> dict[int, Any]:
    """Run ``entrypoint`` on this node's worker group under the supervisor; see module doc.

    Returns ``{global_rank: value}`` for this node's ranks; raises ``WorkerGroupFailed``
    when the group fails for good and ``ConfigError`` for bad settings.
    """
    if bootstrap.importing_parent_main():
        raise RuntimeError(
            "supervisor.launch() was called while a rank was importing the launching script: "
            "guard the launch with `if __name__ == \"__main__\":` (spawn semantics)"
        )
    settings = launch_settings(config, entrypoint, args)
    environ = dict(os.environ)
    cpus = cpus_for(settings)
    name = entrypoint_name(entrypoint)
    if isinstance(entrypoint, str):
        check_runnable(settings, environ)
        ranks = RankDirs(settings_command(settings, environ))
        result = await supervise(settings, environ, command=ranks.command, cpus=cpus,
                                 embedded=True)
        if result.exit_code != 0:
            raise child_failed_error(group_failure(name, result, ranks))
        return dict.fromkeys(ranks.global_ranks())
    python = environ.get("PYTHON_EXEC", sys.executable)
    with CallableJob(entrypoint, args, python) as job:
        result = await supervise(settings, environ, command=job.ranks.command, cpus=cpus,
                                 embedded=True)
        if result.exit_code != 0:
            raise child_failed_error(group_failure(name, result, job.ranks))
        return job.results()


def launch(config: Config, entrypoint: Entrypoint, *args: Any) -> dict[int, Any]:
    """Blocking ``alaunch`` (runs its own event loop: call it where none is running)."""
    result: dict[int, Any] = anyio.run(_alaunch_args, config, entrypoint, args)
    return result


async def _alaunch_args(config: Config, entrypoint: Entrypoint, args: tuple[Any, ...]
                        ) -> dict[int, Any]:
    return await alaunch(config, entrypoint, *args)
