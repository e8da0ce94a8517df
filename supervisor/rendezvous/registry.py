"""The rendezvous backends by name: the one place that maps ``--rdzv-backend`` to a class.

Each backend declares what it can do on the ``Rendezvous`` protocol (``capabilities``,
``extra_pids``, ``etcd_service``); nothing else compares backend names. The settings a
backend needs are checked here (``check_backend``, after ``config.build``), and the ones it
ignores are noted here (``backend_advisories``): the config imports no backend.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec

from supervisor.config import Settings
from supervisor.errors import ConfigError
from supervisor.rendezvous.base import Rendezvous
from supervisor.rendezvous.conf import read_conf

# an etcd-based backend's notices (outage, its end, a replaced lease): ``EventLog.emit``'s shape
EventHook = Callable[..., object]
Factory = Callable[[Settings, str, Path, EventHook | None], Rendezvous]
Advisories = Callable[[Settings], list[tuple[int, str]]]  # (logging level, line)


def _no_notes(settings: Settings) -> list[tuple[int, str]]:
    return []


@dataclass(frozen=True)
class Backend:
    """One ``--rdzv-backend``: how it is built, what it checks and notes of the settings."""

    make: Factory
    needs_endpoint: bool = False  # an existing etcd at --rdzv-endpoint
    # False: nodes neither meet nor join or leave: fixed --nnodes, --node-rank and
    # --master-addr are given (the backend's ``capabilities.coordinates_nodes`` too)
    coordinates_nodes: bool = True
    notes: Advisories = _no_notes  # settings it ignores, effects a user may not expect


def _static_notes(s: Settings) -> list[tuple[int, str]]:
    notes: list[tuple[int, str]] = []
    if s.rdzv_endpoint:
        notes.append((logging.WARNING,
                      f"rdzv_endpoint: ignored by the static backend ({s.rdzv_endpoint!r}); "
                      "it uses master_addr/master_port; for a rendezvous server use "
                      "--rdzv-backend etcd"))
    if s.rdzv_conf:
        notes.append((logging.WARNING,
                      f"rdzv_conf: ignored by the static backend ({s.rdzv_conf!r})"))
    if s.max_nodes > 1:
        notes.append((
            logging.INFO,
            f"nnodes: the static backend does not coordinate nodes: this node "
            f"(node_rank {s.node_rank} of {s.max_nodes}) starts its workers at once and "
            "nothing checks that the other nodes take part (their workers meet in the "
            f"store at master_addr {s.master_addr}); --rdzv-backend etcd makes nodes "
            "join, restart and fail together",
        ))
    return notes


def _etcd_notes(s: Settings) -> list[tuple[int, str]]:
    if s.node_rank == 0:
        return []
    return [(logging.WARNING, f"node_rank: ignored by the etcd backend ({s.node_rank}); "
             "node ranks are assigned at each rendezvous round")]


def _static(settings: Settings, run_id: str, runtime_dir: Path, on_event: EventHook | None
            ) -> Rendezvous:
    from supervisor.rendezvous.static import StaticRendezvous

    return StaticRendezvous(
        run_id, settings.max_nodes, settings.node_rank, settings.master_addr,
        settings.master_port,
    )


def _etcd(settings: Settings, run_id: str, runtime_dir: Path, on_event: EventHook | None
          ) -> Rendezvous:
    """``etcd`` and ``etcd-v2`` both use our etcd v3 backend."""
    from supervisor.rendezvous.etcd.backend import EtcdRendezvous
    from supervisor.rendezvous.etcd.config import RendezvousConfigError, make_config

    try:
        config = make_config(
            endpoint=settings.rdzv_endpoint, run_id=run_id, nnodes=settings.nnodes,
            rdzv_conf=settings.rdzv_conf, local_addr=settings.local_addr,
        )
    except RendezvousConfigError as exc:
        raise ConfigError(str(exc)) from None
    return EtcdRendezvous(config, on_event=on_event)


def _c10d(settings: Settings, run_id: str, runtime_dir: Path, on_event: EventHook | None
          ) -> Rendezvous:
    """May host an etcd whose data lives in ``runtime_dir`` (``--standalone`` keeps
    torchrun's meaning: one node)."""
    from supervisor.rendezvous.c10d.backend import make_c10d_rendezvous
    from supervisor.rendezvous.etcd.config import RendezvousConfigError

    try:
        return make_c10d_rendezvous(
            endpoint=settings.rdzv_endpoint, run_id=run_id, nnodes=settings.nnodes,
            rdzv_conf=settings.rdzv_conf, local_addr=settings.local_addr,
            runtime_dir=runtime_dir, standalone=settings.standalone,
            master_port=settings.master_port, on_event=on_event,
        )
    except RendezvousConfigError as exc:
        raise ConfigError(str(exc)) from None


# the one list of backends (``check_backend`` validates against it). static: no server; etcd and
# etcd-v2: an existing etcd (>= 3.4, our v3 backend for both); c10d: the endpoint's host
# starts a single-member etcd itself. Imported lazily: static never imports etcd's code
BACKENDS: dict[str, Backend] = {
    "static": Backend(_static, coordinates_nodes=False, notes=_static_notes),
    "c10d": Backend(_c10d),
    "etcd": Backend(_etcd, needs_endpoint=True, notes=_etcd_notes),
    "etcd-v2": Backend(_etcd, needs_endpoint=True),
}


def check_backend(s: Settings) -> None:
    """What the chosen backend needs of the settings (``config.build`` checked the rest):
    a known name, an endpoint, a fixed node count. Raises a one-line ``ConfigError``."""
    backend = BACKENDS.get(s.rdzv_backend)
    if backend is None:
        raise ConfigError(f"rdzv_backend: unknown backend {s.rdzv_backend!r} "
                          f"(valid: {', '.join(BACKENDS)})")
    checks = [
        (not backend.needs_endpoint or bool(s.rdzv_endpoint),
         f"rdzv_endpoint: the {s.rdzv_backend} backend needs --rdzv-endpoint "
         "host:port[,host:port]"),
        (backend.coordinates_nodes or s.min_nodes == s.max_nodes,
         f"nnodes: the {s.rdzv_backend} backend needs a fixed node count, got {s.nnodes!r}"),
        (backend.coordinates_nodes or s.node_rank < s.max_nodes,
         f"node_rank: {s.node_rank} is out of range for {s.max_nodes} node(s)"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


def backend_advisories(s: Settings) -> list[tuple[int, str]]:
    """(logging level, line) for valid settings the chosen backend ignores (WARNING), or
    uses in a way a user may not expect (INFO); each names the setting."""
    backend = BACKENDS.get(s.rdzv_backend)
    return backend.notes(s) if backend is not None else []


def make_rendezvous(settings: Settings, run_id: str, runtime_dir: Path, *,
                    on_event: EventHook | None = None) -> Rendezvous:
    """The configured backend; bad endpoints or conf values are one-line ConfigErrors.
    ``on_event`` hears an etcd-based backend's notices (the static backend has none)."""
    backend = BACKENDS.get(settings.rdzv_backend)
    if backend is None:  # check_backend refuses it first; Settings can be built unchecked
        raise ConfigError(f"rdzv_backend: unknown backend {settings.rdzv_backend!r}")
    return backend.make(settings, run_id, runtime_dir, on_event)


def conf_barrier_timeout(settings: Settings, rendezvous: Rendezvous) -> Settings:
    """``--rdzv-conf exit_barrier_timeout=S`` (a documented etcd key) overrides the flag.
    Call after ``make_rendezvous``, which validated the conf."""
    if not rendezvous.capabilities.coordinates_nodes:
        return settings
    # read as the backends read it: quotes a shell left are stripped, unknown keys skipped
    known = read_conf(settings.rdzv_conf, ("exit_barrier_timeout",), settings.rdzv_backend)
    value = dict(known.items).get("exit_barrier_timeout")
    if value is None:
        return settings
    return msgspec.structs.replace(settings, exit_barrier_timeout=float(value))
