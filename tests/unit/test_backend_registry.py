"""Backends come from one registry and declare what they can do; nothing compares names."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.config import ConfigError, Settings, validate
from supervisor.rendezvous.registry import BACKENDS, check_backend, make_rendezvous


def test_the_registry_knows_exactly_the_backends_the_config_accepts() -> None:
    for name, backend in BACKENDS.items():  # the registry checks what its backends need
        settings = Settings(training_script="x.py", rdzv_backend=name,
                            rdzv_endpoint="127.0.0.1:2379" if backend.needs_endpoint else "")
        validate(settings)
        check_backend(settings)
    validate(Settings(training_script="x.py", rdzv_backend="zk"))  # the config names none
    with pytest.raises(ConfigError) as refused:
        check_backend(Settings(training_script="x.py", rdzv_backend="zk"))
    assert str(refused.value) == ("rdzv_backend: unknown backend 'zk' "
                                  "(valid: static, c10d, etcd, etcd-v2)")


def test_the_static_backend_declares_a_fixed_uncoordinated_membership(tmp_path: Path) -> None:
    rendezvous = make_rendezvous(Settings(training_script="x.py"), "job", tmp_path)
    caps = rendezvous.capabilities
    assert (caps.membership_can_change, caps.coordinates_nodes, caps.job_status) == (
        False, False, False)
    assert rendezvous.extra_pids() == [] and rendezvous.etcd_service() is None


@pytest.mark.parametrize("backend", ["etcd", "etcd-v2", "c10d"])
def test_etcd_based_backends_declare_membership_and_job_status(
        tmp_path: Path, backend: str) -> None:
    settings = Settings(training_script="x.py", rdzv_backend=backend, nnodes="1:2",
                        rdzv_endpoint="127.0.0.1:2379")
    rendezvous = make_rendezvous(settings, "job", tmp_path)
    caps = rendezvous.capabilities
    assert caps.membership_can_change and caps.coordinates_nodes and caps.job_status
    assert rendezvous.etcd_service() is not None
    assert rendezvous.extra_pids() == []  # no etcd started (connect() would host it)


def test_an_unknown_backend_is_one_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="rdzv_backend"):
        make_rendezvous(Settings(training_script="x.py", rdzv_backend="zk"), "job", tmp_path)
