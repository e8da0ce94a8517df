"""The master port stays ours until the rank-0 worker's store binds it.

PyTorch's launcher test ``test_init_method_env_with_torchelastic`` (its files are not in
torch's wheel: the case is recreated here) finds a free port, closes it and launches 4
ranks with ``--master-port`` on it. torchrun's agent binds its store on that port at
once; here the rank-0 worker hosts the store (``TORCHELASTIC_USE_AGENT_STORE=False``) and
binds the port only after ``import torch``: seconds, tens of them on a loaded machine,
during which any program of the host could be handed the port (a ``bind`` to port 0,
which picks the same odd ports as the test's own) and rank 0 then failed with
EADDRINUSE. The node of rank 0 now holds the port from its start
(``supervisor.rendezvous.base.hold_port``), as it holds one it picks for an attempt.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

import anyio
import pytest

from tests.support import deps
from tests.support.daemon import supervisor
from tests.support.paths import WORKERS

STORE_PORT = str(WORKERS / "store_port.py")
INIT_METHOD = str(WORKERS / "init_method_env.py")


def intrude(port: int) -> int:
    """Bind ``port`` as an unrelated program would (no ``SO_REUSEADDR``); 0 or the errno."""
    with socket.socket() as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError as exc:
            return exc.errno or -1
    return 0


def port_found_free() -> int:
    """As PyTorch's test finds it (``get_free_port``): bound on localhost, then closed."""
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize("given", [True, False], ids=["given", "picked"])
async def test_nothing_else_can_take_the_master_port_before_rank_0_binds_it(
        tmp_path: Path, given: bool) -> None:
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    flags = ["--master-addr=localhost", f"--master-port={port_found_free()}"] if given else []
    async with supervisor([*flags, "--health-port=0", f"--log-dir={tmp_path}", "--tee=3",
                           STORE_PORT, str(gate)]) as sup:
        port = int((await sup.out.expect(r"waiting (\d+)$", timeout=60)).group(1))
        refused = intrude(port)  # while rank 0 has not bound it yet
        with anyio.fail_after(30):
            await anyio.to_thread.run_sync(lambda: open(gate, "w").close(),
                                           abandon_on_cancel=True)
        await sup.out.expect(rf"listening {port}$", timeout=30)
        assert await sup.wait(timeout=30) == 0
    assert refused == errno.EADDRINUSE


@pytest.mark.torch
@pytest.mark.xdist_group("torch")
@pytest.mark.timeout(300)  # four ranks import torch on two cores: a minute and more, loaded
async def test_pytorchs_init_method_env_with_torchelastic(tmp_path: Path) -> None:
    """4 ranks, ``--master-addr=localhost --master-port=P`` (found free just before),
    ``--monitor-interval=1``, ``init_process_group(init_method="env://")`` and an
    all-reduce that must add up to the world size."""
    deps.need_module("torch")
    args = ["--run-path", "--nnodes=1", "--nproc-per-node=4", "--master-addr=localhost",
            f"--master-port={port_found_free()}", "--monitor-interval=1", "--tee=3",
            "--health-port=0", f"--log-dir={tmp_path}", INIT_METHOD, "--init-method=env://"]
    async with supervisor(args) as sup:
        assert await sup.wait(timeout=240) == 0
    assert sorted(line for line in sup.out.text().splitlines() if line.endswith("Done")) == [
        f"[default{r}]:Done" for r in range(4)]
