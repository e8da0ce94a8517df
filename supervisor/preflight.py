"""Start-up checks of the outside world: each refusal is one line and exit 2.

Everything the command line, the machine or the network can refuse before a worker or a
rendezvous exists: the command, the master address, the devices, the hang dumper, the log
directory and event log, the FIFO's path, and the health socket (bound here, so a busy
port ends the start before this node is counted in by the others).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path

from supervisor.config import DEFAULT_HEALTH_PORT, ConfigError, Settings, node_check_argv
from supervisor.rendezvous.registry import BACKENDS
from supervisor.safepaths import open_below, prepare_run_dir
from supervisor.watchdog.escalate import HangDump, resolve_hang_dump
from supervisor.watchdog.fifo import FifoError, check_fifo_path

# the name these warnings always had (users' log filters know it)
logger = logging.getLogger("supervisor.app")


def check_timer_file(path: Path) -> None:
    """The deadline FIFO's path is usable (private directory, no planted file)."""
    try:
        check_fifo_path(path)
    except FifoError as exc:
        raise ConfigError(f"timer_file: {exc}") from None


def check_node_check(settings: Settings, environ: Mapping[str, str]) -> None:
    """``--node-check``'s program exists and may be run (else exit 2, one line)."""
    argv = node_check_argv(settings)
    if argv and shutil.which(argv[0], path=environ.get("PATH")) is None:
        raise ConfigError(f"node_check: command not found or not executable: {argv[0]!r}")


def check_runnable(settings: Settings, environ: Mapping[str, str]) -> None:
    """Fail early with one line when the command cannot possibly start."""
    script = settings.training_script
    if settings.no_python and shutil.which(script, path=environ.get("PATH")) is None:
        raise ConfigError(f"training_script: command not found: {settings.training_script!r}")
    if not (settings.no_python or settings.module) and not os.path.exists(settings.training_script):
        raise ConfigError(f"training_script: no such file: {settings.training_script!r}")


def check_master_addr(settings: Settings) -> None:
    """The static backend hands ``master_addr`` to every worker as MASTER_ADDR: a name that
    does not resolve here is a start-up error; on one node, where the rank-0 worker hosts
    the store, an address of another machine is almost surely a mistake (a warning)."""
    backend = BACKENDS.get(settings.rdzv_backend)
    if backend is None or backend.coordinates_nodes:  # MASTER_ADDR comes from a round
        return
    addr = settings.master_addr
    try:
        infos = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, socket.gaierror) else str(exc)
        raise ConfigError(f"master_addr: cannot resolve {addr!r}: {reason}") from None
    if settings.max_nodes > 1:
        return
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((sockaddr[0], 0))
        except OSError:
            logger.warning("master_addr: %s is not an address of this machine; on one node "
                           "the rank-0 worker hosts the store here, so workers may not reach "
                           "it (the default is 127.0.0.1)", addr)


def check_devices(settings: Settings, environ: Mapping[str, str]) -> None:
    """Virtual local rank hands each worker one entry of CUDA_VISIBLE_DEVICES: enough?"""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if not settings.virtual_local_rank or visible is None:
        return
    devices = [d for d in visible.split(",") if d.strip()]
    if len(devices) < settings.local_world_size:
        raise ConfigError(
            f"virtual_local_rank: {settings.local_world_size} workers per node but "
            f"CUDA_VISIBLE_DEVICES={visible!r} lists {len(devices)} device(s)"
        )


def check_hang_dump(settings: Settings, environ: Mapping[str, str]) -> HangDump:
    """``--hang-dump``, with py-spy found and able to attach, or a one-line ConfigError."""
    if settings.no_watchdog:
        return HangDump()
    try:
        spec = resolve_hang_dump(settings.hang_dump, environ)
    except ValueError as exc:
        raise ConfigError(f"hang_dump: {exc}") from None
    if spec.mode == "py-spy":
        logger.info("hang dumps by %s", spec.py_spy)
    return spec

def open_health_socket(settings: Settings) -> socket.socket:
    """The health endpoint's listening socket. A port that came from no flag, file or
    variable (the built-in default) moves to a free one when busy, with a warning: two
    jobs with default settings on one workstation both start. A chosen port never moves."""
    host, port = settings.health_host, settings.health_port
    if port is not None:
        return bind_health_socket(host, port)
    try:
        return bind_health_socket(host, DEFAULT_HEALTH_PORT)
    except PortBusy:
        sock = bind_health_socket(host, 0)
        logger.warning(
            "health_port: the default port %d is busy (another supervisor?); listening on "
            "free port %d instead (set --health-port to choose one)",
            DEFAULT_HEALTH_PORT, sock.getsockname()[1],
        )
        return sock


class PortBusy(ConfigError):
    """The port is in use by another socket."""


def bind_health_socket(host: str, port: int) -> socket.socket:
    """Bind and listen now (port 0 picks one): probes queue in the backlog until served.
    Every failure is a one-line ConfigError naming the setting at fault."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise _bind_error(host, port, exc) from None
    sock.setblocking(False)
    return sock


def _bind_error(host: str, port: int, exc: OSError) -> ConfigError:
    where = f"{host}:{port}"
    if isinstance(exc, socket.gaierror):
        return ConfigError(f"health_host: cannot resolve {host!r}: {exc.strerror}")
    if exc.errno == errno.EADDRNOTAVAIL:
        return ConfigError(f"health_host: {host} is not an address of this machine ({where})")
    if exc.errno == errno.EADDRINUSE:
        return PortBusy(f"health_port: cannot listen on {where}: port already in use "
                        "(another supervisor? choose another --health-port, or 0 for any)")
    if exc.errno == errno.EACCES:
        return ConfigError(f"health_port: cannot listen on {where}: permission denied "
                           "(ports below 1024 need root or CAP_NET_BIND_SERVICE)")
    return ConfigError(f"health_port: cannot listen on {where}: {exc.strerror or exc}")

def make_log_root(settings: Settings) -> Path:
    """The log directory, created and writable, or a one-line ConfigError."""
    if settings.log_dir:
        root = Path(settings.log_dir)
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"log_dir: cannot create {root}: {_reason(exc)}") from None
        if not os.access(root, os.W_OK | os.X_OK):
            raise ConfigError(f"log_dir: {root} is not writable by this user")
        return root
    # like torchrun: a fresh directory that outlives the run, so error files stay readable
    try:
        return Path(tempfile.mkdtemp(prefix="elastic-supervisor-"))
    except OSError as exc:
        message = f"log_dir: cannot create a directory in {tempfile.gettempdir()}: {_reason(exc)}"
        raise ConfigError(message + " (set --log-dir or TMPDIR)") from None


def forget_log_root(settings: Settings, log_root: Path, run_id: str) -> None:
    """A start that failed before the run began leaves no directory of its own behind: the
    fresh one ``make_log_root`` made (no ``--log-dir``) is removed when it holds nothing
    but the run directory and its still empty event log. Anything else stays."""
    if settings.log_dir:
        return
    events = log_root / run_id / "events.jsonl"
    with contextlib.suppress(OSError):
        found = os.lstat(events)
        if stat.S_ISREG(found.st_mode) and found.st_size == 0:
            os.unlink(events)
    with contextlib.suppress(OSError):
        os.rmdir(log_root / run_id)
        os.rmdir(log_root)


def check_run_dir(log_root: Path, run_id: str) -> None:
    """``LOG_DIR/RUN_ID`` is made (or found) without following a symlink, and must be this
    user's and not writable by others: a one-line exit 2 otherwise (``safepaths``)."""
    try:
        prepare_run_dir(log_root, run_id)
    except OSError as exc:
        raise ConfigError(f"log_dir: unsafe run directory: {_reason(exc)}") from None


def check_event_log(path: Path, setting: str, log_root: Path) -> None:
    """Open the event log for append once, now: an unusable path stops the start with one
    line (later write errors are logged and the job goes on). Nothing below the log
    directory is followed through a symlink."""
    try:
        fd = open_below(log_root, path, create_dirs=True)
    except OSError as exc:
        raise ConfigError(f"{setting}: cannot open the event log {path}: {_reason(exc)}") from None
    os.close(fd)


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)
