"""The composition root builds a warm pool only for a run that can use one: with no second
attempt possible and nothing to preload, no standby is ever started, and the pool's code
(and the fork server's) is not even imported (the supervisor's resident memory)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from supervisor.config import Settings
from supervisor.core.statusview import ProgressTable
from supervisor.rendezvous.registry import make_rendezvous
from supervisor.wiring import make_pool
from supervisor.workers.guardian import Guardian
from supervisor.workers.spawn import DeathSignal
from supervisor.workers.warm.base import NullPool
from tests.support.paths import REPO


def pool_for(tmp_path: Path, **settings: Any) -> object:
    config = Settings(training_script="x.py", **settings)
    rendezvous = make_rendezvous(config, "job", tmp_path)
    guardian = Guardian()
    try:
        return make_pool(config, rendezvous, {}, DeathSignal(), ProgressTable(), guardian)
    finally:
        guardian.close()


@pytest.mark.parametrize(("settings", "warm"), [
    ({}, False),  # static, --max-restarts 0: the first attempt is the only one
    ({"max_restarts": 1}, True),
    ({"preload": ("json",)}, True),  # the first attempt starts in forked interpreters
    ({"rdzv_backend": "etcd", "nnodes": "1:2", "rdzv_endpoint": "127.0.0.1:2379"}, True),
    ({"max_restarts": 1, "no_warm_restart": True}, False),
])
def test_a_warm_pool_only_where_a_standby_can_serve(
        tmp_path: Path, settings: dict[str, Any], warm: bool) -> None:
    pool = pool_for(tmp_path, **settings)
    assert isinstance(pool, NullPool) is not warm, pool


def test_the_daemon_imports_no_warm_pool_code_until_a_run_needs_it() -> None:
    code = ("import sys, supervisor.app, supervisor.cli; "
            "print(sorted(m for m in sys.modules if m.startswith('supervisor.workers.warm')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, cwd=REPO)
    assert done.stdout.strip() == "['supervisor.workers.warm', 'supervisor.workers.warm.base']"
