"""An etcd-based backend gets its notice hook (outages, their end, replaced leases) when
it is made, through the registry: nothing assigns it later."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from supervisor.config import Settings
from supervisor.rendezvous.registry import make_rendezvous


@pytest.mark.parametrize("backend", ["etcd", "etcd-v2", "c10d"])
def test_the_notice_hook_is_given_at_construction(tmp_path: Path, backend: str) -> None:
    heard: list[tuple[str, dict[str, Any]]] = []

    def hook(kind: str, **fields: Any) -> None:
        heard.append((kind, fields))

    settings = Settings(training_script="x.py", rdzv_backend=backend, nnodes="1:2",
                        rdzv_endpoint="127.0.0.1:2379")
    etcd = make_rendezvous(settings, "job", tmp_path, on_event=hook).etcd_service()
    assert etcd is not None
    etcd._agent.emit("etcd_unreachable", cause="test")  # type: ignore[attr-defined]  # what an outage reports
    assert heard == [("etcd_unreachable", {"cause": "test"})]
