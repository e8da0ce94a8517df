"""Two jobs under one run id (both left at the default ``none``): a node that arrives at
the other job says so at once, in one line, with the fix (supervisor.rendezvous.etcd.sameid)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from supervisor.rendezvous.base import RendezvousClosed
from supervisor.rendezvous.etcd.backend import open_etcd_rendezvous
from supervisor.rendezvous.etcd.config import EtcdRendezvousConfig
from supervisor.rendezvous.etcd.sameid import meet
from tests.support.daemon import supervisor
from tests.support.etcd import EtcdMember, etcd_binary
from tests.support.ports import free_port


def verdict(**state: Any) -> Any:
    facts: dict[str, Any] = {"closed": None, "shape": None, "running_sizes": None,
                             "min_nodes": 1, "max_nodes": 2, "nproc_per_node": 4, **state}
    return meet("none", **facts)


def test_a_fresh_job_is_nothing_to_say() -> None:
    assert verdict() is None
    assert verdict(shape={"nnodes": "1:2"}, running_sizes=[4]) is None  # room for this one


def test_a_full_round_without_this_node_is_a_warning() -> None:
    met = verdict(shape={"nnodes": "1:2"}, running_sizes=[4, 4])
    assert not met.fatal and "a round of 2 node(s) (max 2) runs without this node" in met.line


def test_a_spare_of_a_job_with_its_own_id_is_not_warned() -> None:
    facts: dict[str, Any] = {"closed": None, "shape": {"nnodes": "1:2"},
                             "running_sizes": [4, 4], "min_nodes": 1, "max_nodes": 2,
                             "nproc_per_node": 4}
    assert meet("heal-1", **facts) is None


def test_a_closed_job_is_fatal_and_names_the_fix() -> None:
    met = verdict(closed={"ok": True, "reason": "job succeeded"})
    assert met.fatal and "a job that ended (job succeeded) without this node" in met.line
    assert "pass --rdzv-id" in met.line


def test_another_nnodes_is_fatal() -> None:
    met = verdict(shape={"nnodes": "2:2", "nproc_per_node": 4})
    assert met.fatal and "--nnodes 2:2, this node has --nnodes 1:2" in met.line


def test_another_nproc_per_node_is_a_warning_only() -> None:
    met = verdict(shape={"nnodes": "1:2"}, running_sizes=[2])
    assert not met.fatal and "--nproc-per-node 2, this node 4" in met.line


@pytest.mark.parametrize("shape", ["text", 3, {"nnodes": 7}, ["1:2"]])
def test_a_shape_value_of_any_form_is_no_crash(shape: Any) -> None:
    assert verdict(shape=shape) is None


# ----------------------------------------------------------------------------- real etcd


def config(server: EtcdMember, node: str, **overrides: Any) -> EtcdRendezvousConfig:
    settings: dict[str, Any] = dict(run_id="none", min_nodes=1, max_nodes=1, node_id=node,
                                    join_timeout=20, last_call_timeout=0.1, lease_ttl=2,
                                    request_timeout=2)
    settings.update(overrides)
    return EtcdRendezvousConfig(endpoints=(server.endpoint,), **settings)


@pytest.mark.etcd
async def test_a_node_of_another_shape_is_told_at_once(server: EtcdMember) -> None:
    async with open_etcd_rendezvous(config(server, "first")) as first:
        with anyio.fail_after(10):
            await first.next_round(1)
        # at once: well before its join_timeout (60 s) would end the wait
        async with open_etcd_rendezvous(config(server, "second", max_nodes=2,
                                               join_timeout=60)) as second:
            with anyio.fail_after(20), pytest.raises(RendezvousClosed,
                                                     match="met another job") as caught:
                await second.next_round(1)
    assert "\n" not in str(caught.value) and "--rdzv-id" in str(caught.value)


@pytest.mark.etcd
async def test_another_nproc_per_node_is_warned_and_waits(
        server: EtcdMember, caplog: pytest.LogCaptureFixture) -> None:
    async with open_etcd_rendezvous(config(server, "first")) as first:
        with anyio.fail_after(10):
            await first.next_round(4)
        async with open_etcd_rendezvous(config(server, "second", join_timeout=0.5)) as second:
            # beyond MAX while the round runs: a spare, which waits as long as the job runs
            # (its join_timeout never ends it: docs/healing.md), after the warning
            with caplog.at_level(logging.WARNING), anyio.move_on_after(2) as waiting:
                await second.next_round(2)
            assert waiting.cancelled_caught, "the spare stopped waiting"
    assert "the round running now has --nproc-per-node 4, this node 2" in caplog.text


@pytest.mark.etcd
async def test_a_second_default_c10d_job_is_told_at_once_and_at_the_end(tmp_path: Path) -> None:
    """The newcomer's report: a second c10d job with default settings (run id none) on the
    first's endpoint waited silently, then exited 1 'job none is closed'."""
    etcd_binary()
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    common = ["--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{free_port()}",
              "--health-port=0", "--no-python"]
    hold = f"print('up', flush=True); open({str(gate)!r}).read()"
    async with supervisor([*common, f"--log-dir={tmp_path / 'a'}", sys.executable, "-c",
                           hold]) as first:
        await first.out.expect("up", timeout=30)
        async with supervisor([*common, f"--log-dir={tmp_path / 'b'}", "/bin/true"]) as second:
            await second.err.expect("runs without this node, which waits for room; if this "
                                    "is another job", timeout=15)
            with open(gate, "w"):
                pass  # the first job's worker returns
            assert await first.wait(30) == 0
            assert await second.wait(30) == 1
    ended = [line for line in second.err.lines if "met another job" in line]
    assert len(ended) == 1 and "pass --rdzv-id" in ended[0], second.err.text()
