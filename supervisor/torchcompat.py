"""What code written for torch's launcher expects of the Python API and the CLI.

- ``child_failed_error``: the API's failure, also a torch ``ChildFailedError`` when the
  caller already imported torch's errors module (``except ChildFailedError`` then works);
- ``launch_config_settings``: torch's ``LaunchConfig`` as our settings;
- ``default_logs_spec_names``: the ``--logs-specs`` names that mean torch's default layout.

Torch is never imported here: a caller that uses its classes has imported them already,
so they are looked up in ``sys.modules``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import Mapping
from functools import cache
from typing import Any, cast

from supervisor.errors import ConfigError, RankFailure, WorkerGroupFailed
from supervisor.workers.errorfile import parse_error_file, read_error_data

logger = logging.getLogger(__name__)

ERRORS_MODULE = "torch.distributed.elastic.multiprocessing.errors"
LAUNCHER_MODULE = "torch.distributed.launcher.api"
LOGS_MODULE = "torch.distributed.elastic.multiprocessing.api"
LOGS_SPECS_GROUP = "torchrun.logs_specs"  # torchrun's entry-point group for LogsSpecs
DEFAULT_LOGS_SPECS = "torch.distributed.elastic.multiprocessing:DefaultLogsSpecs"
_NOT_AVAILABLE = "<N/A>"  # torch's ProcessFailure.error_file when there is none
_NO_TRACEBACK = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"


# ------------------------------------------------------------------------ --logs-specs


def default_logs_spec_names() -> frozenset[str]:
    """Names torchrun's ``--logs-specs`` resolves to torch's ``DefaultLogsSpecs``: the
    entry points of group ``torchrun.logs_specs`` that name it (torch's wheel declares
    ``default``), read from package metadata without importing anything."""
    from importlib.metadata import entry_points

    found = {ep.name for ep in entry_points(group=LOGS_SPECS_GROUP)
             if ep.value.replace(" ", "") == DEFAULT_LOGS_SPECS}
    return frozenset({"default", *found})


# ------------------------------------------------------------------------ run id


def unique_run_id() -> str:
    """A fresh run id, made and announced as torch's ``launch_agent`` does."""
    run_id = str(uuid.uuid4().int)
    logger.warning("config has no run_id, generated a random run_id: %s", run_id)
    return run_id


# ------------------------------------------------------------------------ LaunchConfig


def is_launch_config(config: object) -> bool:
    """Whether ``config`` is torch's ``LaunchConfig`` (never imports torch)."""
    module = sys.modules.get(LAUNCHER_MODULE)
    cls = vars(module).get("LaunchConfig") if module is not None else None
    return isinstance(cls, type) and isinstance(config, cls)


def launch_config_settings(config: Any) -> dict[str, Any]:
    """Our settings (snake_case keys) for torch's ``LaunchConfig``, field by field.

    ``run_id`` "" stays unset (the API makes one up, as ``launch_agent`` does);
    ``metrics_cfg`` has no counterpart (our metrics are on ``/metrics``); a custom
    ``LogsSpecs`` is refused (ConfigError).
    """
    raw: dict[str, Any] = {
        "nnodes": f"{config.min_nodes}:{config.max_nodes}",
        "nproc_per_node": str(config.nproc_per_node),
        "role": config.role,
        "rdzv_backend": config.rdzv_backend,
        "max_restarts": config.max_restarts,
        "monitor_interval": float(config.monitor_interval),
        "start_method": config.start_method,
        "event_log_handler": config.event_log_handler,
        "signals_to_handle": config.signals_to_handle,
        "duplicate_stdout_filters": list(config.duplicate_stdout_filters or ()),
        "duplicate_stderr_filters": list(config.duplicate_stderr_filters or ()),
        "virtual_local_rank": bool(config.virtual_local_rank),
    }
    if config.run_id:
        raw["rdzv_id"] = config.run_id
    optional = {"log_line_prefix_template": config.log_line_prefix_template,
                "local_addr": config.local_addr, "shutdown_timeout": config.shutdown_timeout}
    raw.update({k: v for k, v in optional.items() if v is not None})
    if config.numa_options is not None:
        raw["numa_binding"] = str(config.numa_options.affinity_mode.value)
    raw.update(_rendezvous(config.rdzv_backend, config.rdzv_endpoint, config.rdzv_configs))
    raw.update(_logs_specs(config.logs_specs))
    return raw


def _rendezvous(backend: str, endpoint: str, conf: Mapping[str, Any]) -> dict[str, Any]:
    if backend != "static":
        text = ",".join(f"{k}={v}" for k, v in conf.items())
        return {"rdzv_endpoint": endpoint, "rdzv_conf": text}
    # torch's static backend: the endpoint is the master's address, `rank` the node rank
    raw: dict[str, Any] = {"node_rank": int(conf.get("rank", 0))}
    host, sep, port = endpoint.strip().rpartition(":")
    if sep and port.isdigit():
        raw.update(master_addr=host.strip("[]") or "127.0.0.1", master_port=int(port))
    elif endpoint.strip():
        raw["master_addr"] = endpoint.strip()
    return raw


def _logs_specs(specs: Any) -> dict[str, Any]:
    module = sys.modules.get(LOGS_MODULE)
    default = vars(module).get("DefaultLogsSpecs") if module is not None else None
    if specs is None:
        return {}
    if default is None or type(specs) is not default:
        raise ConfigError(
            f"logs_specs: a custom LogsSpecs ({type(specs).__qualname__}) is not supported; "
            "use DefaultLogsSpecs or our settings log_dir, redirects, tee, local_ranks_filter"
        )
    # LogsSpecs keeps what it was given in private attributes; root_log_dir is public
    raw: dict[str, Any] = {"redirects": _std(specs._redirects), "tee": _std(specs._tee)}
    if specs.root_log_dir and specs.root_log_dir != os.devnull:
        raw["log_dir"] = specs.root_log_dir
    if specs._local_ranks_filter:
        raw["local_ranks_filter"] = ",".join(str(r) for r in sorted(specs._local_ranks_filter))
    return raw


def _std(value: Any) -> str:
    """torch's ``Std`` or ``{local_rank: Std}`` as the flag's text (``3``, ``0:3,1:1``)."""
    if isinstance(value, Mapping):
        return ",".join(f"{rank}:{int(std)}" for rank, std in sorted(value.items()))
    return str(int(value))


# ------------------------------------------------------------------------ ChildFailedError


def child_failed_error(exc: WorkerGroupFailed) -> WorkerGroupFailed:
    """``exc``, or when torch's errors module is imported in this process and a worker
    failed, an exception of a class that is both ``type(exc)`` and torch's
    ``ChildFailedError``, whose ``failures`` maps global rank to torch's
    ``ProcessFailure`` (root cause first). Never raises for what a worker wrote."""
    errors = sys.modules.get(ERRORS_MODULE)
    theirs = vars(errors).get("ChildFailedError") if errors is not None else None
    record = vars(errors).get("ProcessFailure") if errors is not None else None
    if not (isinstance(theirs, type) and isinstance(record, type)) or not exc.rank_failures:
        return exc  # torch raises ChildFailedError only for failed workers
    both = _both(type(exc), theirs)(
        exc.name, exc.rank_failures, exit_code=exc.exit_code, root_cause=exc.root_cause)
    torch_failures = {rank: process_failure(record, failure)
                      for rank, failure in exc.rank_failures.items()}
    object.__setattr__(both, "failures", torch_failures)  # torch's shape, for torch's code
    return both


_BOTH: dict[tuple[type, type], type] = {}  # one class per (ours, torch's): isinstance holds


def _both(ours: type[WorkerGroupFailed], theirs: type) -> type[WorkerGroupFailed]:
    known = _BOTH.get((ours, theirs))
    if known is not None:
        return cast("type[WorkerGroupFailed]", known)

    def get_first_failure(self: Any) -> tuple[int, Any]:
        """The root cause (the first failure observed), not torch's earliest timestamp:
        error-file timestamps have a 1 s resolution."""
        rank = next(iter(self.failures))
        return rank, self.failures[rank]

    doc = f"{ours.__doc__}\n\nAlso torch's ChildFailedError (torch was imported)."
    made = _BOTH[ours, theirs] = type(ours.__name__, (ours, theirs), {
        "get_first_failure": get_first_failure, "__doc__": doc, "__module__": ours.__module__,
        "__qualname__": ours.__qualname__,
    })
    return cast("type[WorkerGroupFailed]", made)


# RankFailure's fields that torch's ProcessFailure lacks: a ProcessFailure made here
# carries them too, so code written for our failures keeps working on it
_OUR_FIELDS = ("global_rank", "exit_code", "signal", "traceback")


@cache
def _failure_class(theirs: type) -> type:
    def describe(self: Any) -> str:
        return str(self.rank_failure.describe())

    return type(theirs.__name__, (theirs,), {
        "describe": describe, "__module__": __name__, "__qualname__": theirs.__qualname__,
        "__doc__": f"{theirs.__doc__}\n\nAlso carries supervisor.api.RankFailure's fields.",
    })


def process_failure(cls: type, failure: RankFailure) -> Any:
    """torch's ``ProcessFailure`` for one of our failures, with the fields torch's
    ``__post_init__`` would set from the error file; that method is not run because it
    re-raises on a malformed file, which a worker may have written. The value also has
    ``RankFailure``'s ``global_rank``, ``exit_code``, ``signal``, ``traceback``,
    ``describe()`` and the ``rank_failure`` itself (``message`` is torch's)."""
    kind = _failure_class(cls)
    made: Any = object.__new__(kind)
    made.rank_failure = failure
    for name in _OUR_FIELDS:
        setattr(made, name, getattr(failure, name))
    data = read_error_data(failure.error_file)
    report = parse_error_file(data)
    made.local_rank = failure.local_rank
    made.pid = failure.pid if failure.pid is not None else -1
    made.exitcode = _exitcode(failure)
    if report is not None and isinstance(data, dict):  # as torch reads it
        made.error_file = failure.error_file
        made.error_file_data = data
        made.message = data["message"]
        made.timestamp = int(report.timestamp or failure.timestamp or time.time())
        return made
    made.error_file = _NOT_AVAILABLE
    made.error_file_data = {"message": "<NONE>"}
    made.message = failure.message or _torch_message(made.exitcode, made.pid)
    made.timestamp = int(failure.timestamp or time.time())
    return made


def _exitcode(failure: RankFailure) -> int:
    """torch's convention: a negative exit code is the signal that ended the process."""
    if failure.exit_code is not None:
        return failure.exit_code
    try:
        return -int(signal.Signals[failure.signal or ""])
    except KeyError:
        return -1


def _torch_message(exitcode: int, pid: int) -> str:
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = _NOT_AVAILABLE
        return f"Signal {-exitcode} ({name}) received by PID {pid}"
    return _NO_TRACEBACK
