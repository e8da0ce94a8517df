"""Free loopback ports, for servers that must be told their port before they bind it."""

from __future__ import annotations

import itertools
import os
import socket

# Below the kernel's ephemeral range (32768-60999 by default), which every ``--health-port
# 0`` server and every outgoing connection of the suite draws from: a port handed out by
# the kernel and closed again could be given to any of them before its caller binds it.
# Each xdist worker takes its own block, so two workers never hand out the same port; and
# torchrun's default store port (29500) lies outside every block.
# ELASTIC_SUPERVISOR_TEST_PORT_BASE moves the blocks, for two suites run at once on one
# machine (each xdist worker of each suite still gets a block of its own).
BASE = int(os.environ.get("ELASTIC_SUPERVISOR_TEST_PORT_BASE", "21000"))
BLOCK = 1000
BLOCKS = 8


def _worker_index() -> int:
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")  # "gw3"
    digits = name.lstrip("gw")
    return (int(digits) if digits.isdigit() else 0) % BLOCKS


_NEXT = itertools.count()


def free_port() -> int:
    """A loopback port no other test of this run is handed, free right now; the next one
    of this worker's block that binds (a port some other program holds is skipped)."""
    start = BASE + _worker_index() * BLOCK
    for _ in range(BLOCK):
        port = start + next(_NEXT) % BLOCK
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {start}-{start + BLOCK - 1}")
