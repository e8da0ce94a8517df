"""The rendezvous backends by name: the one place that maps ``--rdzv-backend`` to a class.

Each backend declares what it can do on the ``Rendezvous`` protocol (``capabilities``,
``extra_pids``, ``etcd_service``); nothing else compares backend names.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import msgspec

from supervisor.config import ConfigError, Settings
from supervisor.rendezvous.base import Rendezvous

Factory = Callable[[Settings, str, Path], Rendezvous]


def _static(settings: Settings, run_id: str, runtime_dir: Path) -> Rendezvous:
    from supervisor.rendezvous.static import StaticRendezvous

    return StaticRendezvous(
        run_id, settings.max_nodes, settings.node_rank, settings.master_addr,
        settings.master_port,
    )


def _etcd(settings: Settings, run_id: str, runtime_dir: Path) -> Rendezvous:
    """``etcd`` and ``etcd-v2`` both use our etcd v3 backend."""
    from supervisor.rendezvous.etcd import EtcdRendezvous, RendezvousConfigError, make_config

    try:
        config = make_config(
            endpoint=settings.rdzv_endpoint, run_id=run_id, nnodes=settings.nnodes,
            rdzv_conf=settings.rdzv_conf, local_addr=settings.local_addr,
        )
    except RendezvousConfigError as exc:
        raise ConfigError(str(exc)) from None
    return EtcdRendezvous(config)


def _c10d(settings: Settings, run_id: str, runtime_dir: Path) -> Rendezvous:
    """May host an etcd whose data lives in ``runtime_dir`` (``--standalone`` keeps
    torchrun's meaning: one node)."""
    from supervisor.rendezvous.c10d import make_c10d_rendezvous
    from supervisor.rendezvous.etcd import RendezvousConfigError

    try:
        return make_c10d_rendezvous(
            endpoint=settings.rdzv_endpoint, run_id=run_id, nnodes=settings.nnodes,
            rdzv_conf=settings.rdzv_conf, local_addr=settings.local_addr,
            runtime_dir=runtime_dir, standalone=settings.standalone,
            master_port=settings.master_port,
        )
    except RendezvousConfigError as exc:
        raise ConfigError(str(exc)) from None


# imported lazily: the static backend never imports anything of etcd
BACKENDS: dict[str, Factory] = {"static": _static, "c10d": _c10d, "etcd": _etcd,
                                "etcd-v2": _etcd}


def make_rendezvous(settings: Settings, run_id: str, runtime_dir: Path) -> Rendezvous:
    """The configured backend; bad endpoints or conf values are one-line ConfigErrors."""
    factory = BACKENDS.get(settings.rdzv_backend)
    if factory is None:  # config validation lists the same names (config.RDZV_BACKENDS)
        raise ConfigError(f"rdzv_backend: unknown backend {settings.rdzv_backend!r}")
    return factory(settings, run_id, runtime_dir)


def conf_barrier_timeout(settings: Settings, rendezvous: Rendezvous) -> Settings:
    """``--rdzv-conf exit_barrier_timeout=S`` (a documented etcd key) overrides the flag.
    Call after ``make_rendezvous``, which validated the conf."""
    if not rendezvous.capabilities.coordinates_nodes:
        return settings
    pairs = (item.partition("=") for item in settings.rdzv_conf.split(","))
    value = {key.strip(): raw.strip() for key, _, raw in pairs}.get("exit_barrier_timeout")
    if value is None:
        return settings
    return msgspec.structs.replace(settings, exit_barrier_timeout=float(value))
