"""Typed configuration, parsed and validated once at the edge.

Sources, lowest to highest precedence: built-in defaults < TOML file (``--config``) <
environment (``PET_<KEY>`` like torchrun, plus a few ``TORCHELASTIC_*`` knobs) < CLI flags.
Keys are the snake_case of the long CLI flags. Everything below this module receives a
``Settings`` value and never reads ``os.environ`` itself.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, Literal

import msgspec

from supervisor.core.nodehealth import Limits, check_limits, start_warnings
from supervisor.errors import ConfigError as ConfigError
from supervisor.suggest import did_you_mean


class Settings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Every setting of ``elastic-supervisor run`` (the flags without ``--``, ``-`` as ``_``)."""

    # what to run
    training_script: str = ""
    training_script_args: list[str] = msgspec.field(default_factory=list)
    module: bool = False
    no_python: bool = False
    run_path: bool = False
    # the worker group
    nnodes: str = "1:1"
    nproc_per_node: str = "1"
    node_rank: int = 0
    role: str = "default"
    max_restarts: int = 0
    start_method: Literal["spawn", "forkserver", "fork"] = "spawn"
    virtual_local_rank: bool = False
    numa_binding: Literal["node", "socket", "exclusive", "core-complex"] | None = None
    # rendezvous
    rdzv_backend: str = "static"  # a name in rendezvous/registry.py's BACKENDS (it checks)
    rdzv_endpoint: str = ""
    rdzv_id: str = "none"
    rdzv_conf: str = ""
    standalone: bool = False
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    local_addr: str | None = None
    # stopping and restarting
    monitor_interval: float = 0.1  # accepted for torchrun compatibility; detection is event-driven
    shutdown_timeout: float = 30.0
    exit_barrier_timeout: float = 300.0
    restart_backoff: str = "0:0"
    restart_budget_window: float | None = None
    no_restart_exit_codes: list[int] = msgspec.field(default_factory=list)
    restart_exit_codes: list[int] | None = None
    # output
    log_dir: str | None = None
    redirects: str = "0"
    tee: str = "0"
    local_ranks_filter: str = ""
    log_line_prefix_template: str | None = None
    duplicate_stdout_filters: list[str] = msgspec.field(default_factory=list)
    duplicate_stderr_filters: list[str] = msgspec.field(default_factory=list)
    event_log: str | None = None
    event_log_handler: str = "null"  # torchrun's; our events always go to the JSONL log
    logs_specs: str | None = None  # torchrun's LogsSpecs: only its default (our own layout)
    signals_to_handle: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # accepted and validated
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["auto", "text", "json"] = "auto"
    # health and watchdog
    health_host: str = "0.0.0.0"
    health_port: int | None = None  # None: DEFAULT_HEALTH_PORT, or a free port if it is busy
    no_health: bool = False
    progress_timeout: float = 60.0
    progress_pattern: str | None = None  # output lines that are progress (regex)
    # /readyz: 200 at launch, or only once every rank expected to progress did (health.py)
    ready_when: Literal["launched", "progress"] = "progress"
    timer_file: str | None = None
    no_watchdog: bool = False
    hang_dump: str = "none"
    hang_state_timeout: float = 60.0
    # the event loop's nice value (and its autogroup's), workers keep 0: supervisor/priority.py
    loop_nice: int = 0
    no_warm_restart: bool = False  # restarted workers start in pre-started interpreters
    preload: list[str] = msgspec.field(default_factory=list)  # modules standbys import
    # healing (core.nodehealth): a bad node takes itself out, a spare takes its place
    max_node_failures: int = 0  # root-cause failures in the window that quarantine (0: off)
    node_failure_window: float = 3600.0
    max_quarantined: int = 1  # job-wide cap: a bug can never quarantine every node
    node_check: str | None = None  # a command line (no shell); 0 = healthy
    node_check_timeout: float = 60.0
    node_check_interval: float = 0.0  # while the workers run (0: never)
    node_check_retry: float = 30.0  # a node failing its check before joining re-checks
    # training-state snapshots (supervisor.snapshot, docs/snapshots.md)
    snapshot_memory_dir: str = "/dev/shm"  # a tmpfs: where the regions are made
    snapshot_memory_limit: str = ""  # the largest snapshot kept, e.g. 4G ("": no limit)
    snapshot_dir: str | None = None  # complete steps persisted there, resumed from
    snapshot_persist_interval: float = 300.0  # seconds between two persisted steps
    snapshot_resume_any: bool = False  # use a snapshot_dir of another run id

    # ------------------------------------------------------------------ derived values
    @property
    def min_nodes(self) -> int:
        return _nnodes(self.nnodes)[0]

    @property
    def max_nodes(self) -> int:
        return _nnodes(self.nnodes)[1]

    @property
    def local_world_size(self) -> int:
        return _nproc(self.nproc_per_node)

    @property
    def backoff(self) -> tuple[float, float]:
        return _backoff(self.restart_backoff)

    @property
    def snapshot_limit(self) -> int | None:
        """``snapshot_memory_limit`` in bytes (None: no limit)."""
        return _bytes("snapshot_memory_limit", self.snapshot_memory_limit)


DEFAULT_HEALTH_PORT: Final = 29480  # used when no flag, file or variable names a port

FIELDS: frozenset[str] = frozenset(Settings.__struct_fields__)
_BOOL_WORDS = {"1": True, "true": True, "yes": True, "on": True,
               "0": False, "false": False, "no": False, "off": False, "": False}
_LIST_FIELDS = {
    "training_script_args", "no_restart_exit_codes", "restart_exit_codes",
    "duplicate_stdout_filters", "duplicate_stderr_filters", "preload",
}


def _nnodes(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", text)
    if not m:
        raise ConfigError(f"nnodes: expected N or MIN:MAX, got {text!r}")
    lo = int(m.group(1))
    hi = int(m.group(2)) if m.group(2) else lo
    if not 1 <= lo <= hi:
        raise ConfigError(f"nnodes: need 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def _nproc(text: str) -> int:
    if text in ("cpu", "auto"):
        # no accelerator support here: torchrun's "auto" also falls back to the CPU count,
        # counted as torch 2.13's cpu_count does: the CPUs this process may run on
        return len(os.sched_getaffinity(0)) or 1
    if text == "gpu":
        raise ConfigError("nproc_per_node: 'gpu' needs CUDA devices, none visible")
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise ConfigError("nproc_per_node: expected a positive integer, cpu, gpu or auto, "
                          f"got {text!r}")
    return int(text)


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _bytes(key: str, text: str) -> int | None:
    """A size such as 512M, 4G or 1048576 (bytes); "" is None."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not text.strip():
        return None
    if not m or int(m.group(1)) <= 0:
        raise ConfigError(f"{key}: expected a size such as 512M or 4G, got {text!r}")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def _backoff(text: str) -> tuple[float, float]:
    m = re.fullmatch(r"\s*([0-9.]+)\s*:\s*([0-9.]+)\s*", text)
    try:
        base, top = (float(m.group(1)), float(m.group(2))) if m else (-1.0, -1.0)
    except ValueError:
        base = top = -1.0
    if base < 0 or top < base:
        raise ConfigError(f"restart_backoff: expected BASE:MAX seconds, BASE <= MAX, got {text!r}")
    return base, top


def load_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML config file into raw settings; unknown keys are an error."""
    import tomllib  # only with --config: kept off the start-up path of a flags-only run

    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    for key in raw:
        if key.replace("-", "_") not in FIELDS:
            raise ConfigError(f"{_where(path, key)}: {_unknown(key.replace('-', '_'))}")
    return {k.replace("-", "_"): v for k, v in raw.items()}


def _where(path: str | Path, key: str) -> str:
    """``config file PATH, line N`` for top-level ``key`` (tomllib gives no line numbers,
    so the text is scanned for the line that defines it: ``key =``, ``"key" =``,
    ``key.sub =`` or a ``[key]`` table)."""
    quoted = rf"(?:{re.escape(key)}|\"{re.escape(key)}\"|'{re.escape(key)}')"
    pattern = re.compile(rf"^\s*(?:\[\[?\s*{quoted}\s*[\].]|{quoted}\s*[=.])")
    try:
        with open(path, encoding="utf-8") as f:
            line = next((n for n, text in enumerate(f, 1) if pattern.match(text)), None)
    except (OSError, UnicodeDecodeError):
        line = None
    return f"config file {path}" + (f", line {line}" if line is not None else "")


def _unknown(key: str) -> str:
    return f"unknown setting {key!r}{did_you_mean(key, FIELDS)}"


def from_environ(environ: Mapping[str, str]) -> dict[str, Any]:
    """Settings given as ``PET_<KEY>`` (torchrun's convention) and TORCHELASTIC_* knobs."""
    raw: dict[str, Any] = {}
    for key in FIELDS:
        value = environ.get(f"PET_{key.upper()}")
        if value is not None:
            raw[key] = value
    aliases = {
        "TORCHELASTIC_HEALTH_CHECK_PORT": "health_port",
        "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "log_line_prefix_template",
        "TORCHELASTIC_TIMER_FILE": "timer_file",
        "TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT": "hang_state_timeout",
    }
    for env_key, key in aliases.items():
        if env_key in environ and key not in raw:
            raw[key] = environ[env_key]
    if environ.get("TORCHELASTIC_ENABLE_FILE_TIMER", "").lower() in ("0", "false"):
        raw.setdefault("no_watchdog", "1")
    return raw


def _coerce(key: str, value: Any) -> Any:
    """Turn strings from the environment or flags into the field's shape."""
    if key in ("nnodes", "nproc_per_node") and isinstance(value, int) and value > 0:
        return str(value)  # `nnodes = 2` in TOML means "2"
    if not isinstance(value, str):
        return value
    field_type = Settings.__annotations__.get(key, "")
    if field_type == "bool":
        word = value.strip().lower()
        if word not in _BOOL_WORDS:
            raise ConfigError(f"{key}: expected a boolean, got {value!r}")
        return _BOOL_WORDS[word]
    if key in _LIST_FIELDS and key != "training_script_args":
        items = [v.strip() for v in value.split(",") if v.strip()]
        return items
    return value


def build(*layers: Mapping[str, Any]) -> Settings:
    """Merge raw layers (later wins) and validate into ``Settings``."""
    merged: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if key not in FIELDS:
                raise ConfigError(_unknown(key))
            merged[key] = _coerce(key, value)
    try:
        settings = msgspec.convert(merged, Settings, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(_validation_message(str(exc))) from None
    validate(settings)
    return settings


def _validation_message(text: str) -> str:
    m = re.search(r"^(.*?) - at `\$\.([A-Za-z_]+)(.*)`$", text)
    if m:
        # "Expected int | null": null is the unset default, never something to type in
        what = m.group(1).replace("`", "").replace(" | null", "")
        return f"{m.group(2)}{m.group(3)}: {what}"
    return text


def validate(s: Settings) -> None:
    """Range and cross-field checks msgspec's types cannot express. What the chosen
    rendezvous backend needs is the registry's to check (``registry.check_backend``)."""
    # each raises ConfigError if bad
    s.min_nodes, s.local_world_size, s.backoff, s.snapshot_limit  # noqa: B018
    checks: list[tuple[bool, str]] = [
        (s.max_restarts >= 0, f"max_restarts: must be >= 0, got {s.max_restarts}"),
        (s.node_rank >= 0, f"node_rank: must be >= 0, got {s.node_rank}"),
        (s.shutdown_timeout >= 0, f"shutdown_timeout: must be >= 0, got {s.shutdown_timeout}"),
        (s.exit_barrier_timeout >= 0, "exit_barrier_timeout: must be >= 0"),
        (s.progress_timeout > 0, f"progress_timeout: must be > 0, got {s.progress_timeout}"),
        (s.hang_state_timeout > 0, "hang_state_timeout: must be > 0"),
        (-20 <= s.loop_nice <= 0, f"loop_nice: must be -20..0 (0: off), got {s.loop_nice}"),
        (s.health_port is None or 0 <= s.health_port <= 65535,
         f"health_port: must be 0..65535, got {s.health_port}"),
        (s.master_port is None or 0 <= s.master_port <= 65535,
         f"master_port: must be 0..65535, got {s.master_port}"),
        (s.restart_budget_window is None or s.restart_budget_window > 0,
         "restart_budget_window: must be > 0 seconds"),
        (bool(s.training_script), "training_script: nothing to run (give a script or command)"),
        (not (s.module and s.no_python), "module: --module and --no-python are mutually exclusive"),
        (s.hang_dump in ("none", "py-spy")
         or s.hang_dump.removeprefix("signal:") in signal.Signals.__members__,
         f"hang_dump: expected none, py-spy or signal:SIGNAME, got {s.hang_dump!r}"),
    ]
    if s.logs_specs is not None:
        from supervisor.torchcompat import default_logs_spec_names

        checks.append((s.logs_specs in default_logs_spec_names(),
                       f"logs_specs: {s.logs_specs!r} is not torch's default LogsSpecs, and "
                       "LogsSpecs plugins are not supported; use log_dir, redirects, tee and "
                       "local_ranks_filter (the default layout)"))
    for name in filter(None, (n.strip() for n in s.signals_to_handle.split(","))):
        known = name in signal.Signals.__members__
        checks.append((known, f"signals_to_handle: unknown signal {name!r}"))
    for module in s.preload:
        ok = all(part.isidentifier() for part in module.split("."))
        checks.append((ok, f"preload: {module!r} is not a module name (e.g. torch,torch._dynamo)"))
    checks.append((s.snapshot_persist_interval > 0,
                   "snapshot_persist_interval: must be > 0 seconds"))
    checks += [(False, problem) for problem in check_limits(healing_limits(s))]
    checks += [
        (s.node_check_timeout > 0, "node_check_timeout: must be > 0 seconds"),
        (s.node_check_interval >= 0, "node_check_interval: must be >= 0 seconds (0: never)"),
        (s.node_check_retry > 0, "node_check_retry: must be > 0 seconds"),
        (s.node_check is None or _splits(s.node_check),
         f"node_check: expected a command line, got {s.node_check!r}"),
    ]
    if s.progress_pattern:
        try:
            re.compile(s.progress_pattern)
        except re.error as exc:
            checks.append((False, f"progress_pattern: not a regular expression: {exc}"))
    for code in (*s.no_restart_exit_codes, *(s.restart_exit_codes or ())):
        checks.append((0 <= code <= 255, f"no_restart_exit_codes: {code} is not an exit code"))
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


def healing_limits(s: Settings) -> Limits:
    return Limits(s.max_node_failures, s.node_failure_window, s.max_quarantined)


def healing_enabled(s: Settings) -> bool:
    """Node checks (and the built-in disk check) run only when healing is asked for."""
    return s.max_node_failures > 0 or s.node_check is not None


def node_check_argv(s: Settings) -> list[str]:
    """The node check's argv (split like a shell would, but never run by one)."""
    return shlex.split(s.node_check) if s.node_check else []


def _splits(text: str) -> bool:
    try:
        return bool(shlex.split(text))
    except ValueError:
        return False


def advisories(s: Settings) -> list[tuple[int, str]]:
    """(logging level, line) for valid settings that have no effect (WARNING), or an effect
    a user may not expect (INFO); each names the setting. The rendezvous backend's own are
    ``registry.backend_advisories``."""
    notes: list[tuple[int, str]] = [
        (logging.WARNING, line) for line in start_warnings(healing_limits(s), s.max_restarts)]
    if s.logs_specs is not None:
        notes.append((logging.INFO,
                      f"logs_specs: {s.logs_specs!r} is torch's DefaultLogsSpecs: worker "
                      "logs follow our own layout, LOG_DIR/RUN_ID/attempt_K/LOCAL_RANK/ "
                      "(set by log_dir, redirects, tee, local_ranks_filter)"))
    if s.preload and s.no_warm_restart:  # it wins: every attempt starts cold
        notes.append((logging.WARNING,
                      f"preload: no effect ({','.join(s.preload)}): no_warm_restart starts "
                      "every attempt cold, without the fork server"))
    return notes


def to_toml_dict(settings: Settings) -> dict[str, Any]:
    """The resolved settings as plain data (for ``check-config``)."""
    return {k: v for k, v in msgspec.to_builtins(settings).items() if v is not None}
