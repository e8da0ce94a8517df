"""The rendezvous backends by name: the one place that maps ``--rdzv-backend`` to a class.

Each backend declares what it can do on the ``Rendezvous`` protocol (``capabilities``,
``extra_pids``, ``etcd_service``); nothing else compares backend names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from supervisor.errors import ConfigError
from supervisor.rendezvous.base import Rendezvous
from supervisor.rendezvous.conf import read_conf

if TYPE_CHECKING:  # config validates against BACKENDS: it imports this module
    from supervisor.config import Settings

# an etcd-based backend's notices (outage, its end, a replaced lease): ``EventLog.emit``'s shape
EventHook = Callable[..., object]
Factory = Callable[["Settings", str, Path, EventHook | None], Rendezvous]


@dataclass(frozen=True)
class Backend:
    """One ``--rdzv-backend``: how it is built, and what the config checks for it."""

    make: Factory
    needs_endpoint: bool = False  # an existing etcd at --rdzv-endpoint
    # False: nodes neither meet nor join or leave: fixed --nnodes, --node-rank and
    # --master-addr are given (the backend's ``capabilities.coordinates_nodes`` too)
    coordinates_nodes: bool = True


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
    from supervisor.rendezvous.etcd import EtcdRendezvous, RendezvousConfigError, make_config

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
    from supervisor.rendezvous.c10d import make_c10d_rendezvous
    from supervisor.rendezvous.etcd import RendezvousConfigError

    try:
        return make_c10d_rendezvous(
            endpoint=settings.rdzv_endpoint, run_id=run_id, nnodes=settings.nnodes,
            rdzv_conf=settings.rdzv_conf, local_addr=settings.local_addr,
            runtime_dir=runtime_dir, standalone=settings.standalone,
            master_port=settings.master_port, on_event=on_event,
        )
    except RendezvousConfigError as exc:
        raise ConfigError(str(exc)) from None


# the one list of backends (config.py validates against it). static: no server; etcd and
# etcd-v2: an existing etcd (>= 3.4, our v3 backend for both); c10d: the endpoint's host
# starts a single-member etcd itself. Imported lazily: static never imports etcd's code
BACKENDS: dict[str, Backend] = {
    "static": Backend(_static, coordinates_nodes=False),
    "c10d": Backend(_c10d),
    "etcd": Backend(_etcd, needs_endpoint=True),
    "etcd-v2": Backend(_etcd, needs_endpoint=True),
}


def make_rendezvous(settings: Settings, run_id: str, runtime_dir: Path, *,
                    on_event: EventHook | None = None) -> Rendezvous:
    """The configured backend; bad endpoints or conf values are one-line ConfigErrors.
    ``on_event`` hears an etcd-based backend's notices (the static backend has none)."""
    backend = BACKENDS.get(settings.rdzv_backend)
    if backend is None:  # config validation refuses it first; Settings can be built unchecked
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
