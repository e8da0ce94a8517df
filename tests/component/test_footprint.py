"""Footprint guards: what the daemon's process maps and leaves in its environment."""

from __future__ import annotations

import subprocess
import sys


def test_aiohttp_is_imported_without_cxx_frozenlist() -> None:
    # frozenlist's C++ extension would map libstdc++ (~0.9 MiB resident) into the daemon;
    # the switch that avoids it must not leak into the environment workers inherit
    code = (
        "import os, supervisor.health.server, supervisor.rendezvous.etcd_client\n"
        "maps = open('/proc/self/maps').read()\n"
        "print('libstdc++' in maps, 'FROZENLIST_NO_EXTENSIONS' in os.environ)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.split() == ["False", "False"]
