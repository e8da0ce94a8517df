"""The job-wide view: every supervisor's summary in etcd, shown by ``status --rdzv-endpoint``.

Three real supervisors on one real etcd (``--nnodes 2:2``): two form the job, the third
waits to join; then a worker of one node fails and that node restarts.
``elastic-supervisor status --rdzv-endpoint E --rdzv-id JOB`` must show all three with
their states from etcd alone (no node's HTTP port is reached).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from supervisor.rendezvous.etcd.summary import STATUS_ROOT, read_summaries
from supervisor.rendezvous.etcd.wire.client import EtcdClient
from tests.support.nodes import cluster
from tests.support.paths import REPO

pytestmark = pytest.mark.etcd


async def status_command(*args: str) -> tuple[int, str, str]:
    done = await anyio.run_process(
        [sys.executable, "-m", "supervisor", "status", *args], check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    return done.returncode, done.stdout.decode(), done.stderr.decode()


async def wait_summaries(client: EtcdClient, run_id: str, check: Any) -> list[dict[str, Any]]:
    """Read the summaries until ``check(rows)`` holds (each node writes on its changes)."""
    with anyio.fail_after(30):
        while True:
            rows = await read_summaries(client, run_id)
            if check(rows):
                return rows
            await anyio.sleep(0.2)  # etcd has no "wait until this predicate" call


def by_state(rows: list[dict[str, Any]]) -> list[str]:
    return sorted(str(r["state"]) for r in rows)


async def test_status_shows_every_node_of_the_job_from_etcd(
    tmp_path: Path, server: Any
) -> None:
    flags = ["--max-restarts", "2", "--restart-backoff", "30:30"]
    worker = ["--hang", "--usr1-exit", "3", "--fail-rank", "0"]
    async with cluster(tmp_path, server.endpoint, nnodes="2:2", flags=flags,
                       worker=worker) as job, EtcdClient([server.endpoint]) as client:
        first = await job.start(2)
        await job.groups(first, 4)
        await job.start(1)  # the third node: waits to join the full job
        rows = await wait_summaries(client, job.run_id, lambda r: len(r) == 3)
        rows = await wait_summaries(
            client, job.run_id,
            lambda r: by_state(r) == ["rendezvous", "running", "running"])
        # the summaries live beside the rendezvous keys, bound to each node's lease
        listed = await client.range(STATUS_ROOT + "/", prefix=True)
        assert all(kv.key.startswith(f"{STATUS_ROOT}/{job.run_id}/") for kv in listed.kvs)
        assert all(kv.lease != 0 for kv in listed.kvs)
        code, out, err = await status_command(
            "--rdzv-endpoint", server.endpoint, "--rdzv-id", job.run_id, "--json")
        assert code == 0, err
        shown = json.loads(out)
        assert by_state(shown) == ["rendezvous", "running", "running"]
        waiting = next(r for r in shown if r["state"] == "rendezvous")
        assert waiting["attempt"] == 0 and waiting["health_url"].startswith("http://")
        assert all(r["goodput_now"] is not None for r in shown)

        # rank 0's worker fails: its node restarts (1 of 2; a jittered backoff first)
        pid = next(int(m.group(1)) for node in first
                   if (m := re.search(r"^ready 0 (\d+) 0$", node.sup.out.text(), re.M)))
        os.kill(pid, signal.SIGUSR1)
        rows = await wait_summaries(client, job.run_id,
                                    lambda r: any(x["restarts"] == 1 for x in r))
        code, out, err = await status_command(
            "--rdzv-endpoint", server.endpoint, "--rdzv-id", job.run_id)
        print(out)
        assert code == 0, err
        table = out.splitlines()
        assert table[0] == f"job {job.run_id}: 3 node(s)" and len(table) == 5
        failed = next(r for r in rows if r["restarts"] == 1)
        assert "exited with code 3" in failed["last_failure"]
        assert failed["state"] in ("stopping", "backoff", "rendezvous", "starting", "running")
        line = next(t for t in table if t.startswith(failed["node_id"]))
        assert " 1/2 " in line and "exited with code 3" in line


async def test_status_without_etcd_is_one_clear_line(tmp_path: Path) -> None:
    code, out, err = await status_command(
        "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-id", "nope", "--timeout", "1")
    assert code == 1 and out == ""
    assert err.startswith("elastic-supervisor status: cannot read the job's status from etcd")
    assert "Traceback" not in err
    code, _, err = await status_command("--rdzv-id", "nope")
    assert code == 2 and "go together" in err


async def test_publisher_writes_only_changes_bound_to_the_lease(
    server: Any
) -> None:
    from supervisor.rendezvous.etcd.summary import SummaryPublisher, summary_prefix

    summary = {"node_id": "n0", "state": "running", "attempt": 1}
    lease = [0]
    async with EtcdClient([server.endpoint]) as client:
        publisher = SummaryPublisher(client, "job", "n0", lambda: lease[0], lambda: summary)
        assert await publisher.write_if_changed() and publisher.writes == 0  # no lease yet
        lease[0], _ = await client.lease_grant(5)
        await publisher.write_if_changed()
        await publisher.write_if_changed()  # unchanged: no second put
        assert publisher.writes == 1
        summary["state"] = "stopping"
        await publisher.write_if_changed()
        kv = await client.get(summary_prefix("job") + "n0")
        assert kv is not None and kv.version == 2 and kv.lease == lease[0]
        assert json.loads(kv.value)["state"] == "stopping"
        await client.lease_revoke(lease[0])  # the node is gone: so is its summary
        assert await read_summaries(client, "job") == []


async def test_status_reads_a_tls_etcd_with_the_options_of_run(
    tmp_path: Path, factory: Any
) -> None:
    from supervisor.rendezvous.etcd.summary import summary_prefix
    from supervisor.rendezvous.etcd.wire.client import TlsFiles
    from tests.support.etcd import make_tls_material
    tls = make_tls_material(tmp_path / "tls")
    member = factory.single(tls=tls)
    files = TlsFiles(cacert=str(tls.ca), cert=str(tls.client_cert), key=str(tls.client_key))
    async with EtcdClient([member.endpoint], tls=files) as client:
        row = {"node_id": "n0", "node_rank": 0, "host": "h", "state": "running",
               "attempt": 1, "restarts": 0, "max_restarts": 3, "health_url": None,
               "last_failure": None, "goodput": None}
        await client.put(summary_prefix("tlsjob") + "n0", json.dumps(row))
    conf = f"cacert={tls.ca},cert={tls.client_cert},key={tls.client_key}"
    endpoint = member.endpoint.removeprefix("https://")
    code, out, err = await status_command(
        "--rdzv-endpoint", endpoint, "--rdzv-id", "tlsjob", "--rdzv-conf", conf)
    assert code == 0, err
    assert "job tlsjob: 1 node(s)" in out and " running " in out
    code, _, err = await status_command("--rdzv-endpoint", endpoint, "--rdzv-id", "tlsjob",
                                        "--timeout", "2")  # no client certificate
    assert code == 1 and "Traceback" not in err


async def test_node_loss_is_accounted_as_node_lost_and_its_summary_vanishes(
    tmp_path: Path, server: Any
) -> None:
    from tests.support.nodes import LOCAL, TTL, node_with_group_rank

    async with cluster(tmp_path, server.endpoint, nnodes="1:2",
                       flags=["--progress-timeout", "1"]) as job, \
            EtcdClient([server.endpoint]) as client:
        nodes = await job.start(2)
        groups = await job.groups(nodes, 2 * LOCAL)
        victim = node_with_group_rank(nodes, groups, 1)
        (survivor,) = [n for n in nodes if n is not victim]
        rows = await wait_summaries(client, job.run_id, lambda r: len(r) == 2 and all(
            x["state"] == "running" and x["node_rank"] is not None for x in r))
        victim_id = next(r["node_id"] for r in rows if r["node_rank"] == 1)
        # 0, or 1 when the survivor formed round 0 alone (the other node started late on a
        # busy machine) and the scale-up restarted it into round 1
        attempt = len(survivor.events("group_started")) - 1
        victim.sup.signal(signal.SIGKILL)
        await job.groups([survivor], LOCAL, timeout=TTL + 10)

        def lost() -> list[dict[str, Any]]:
            return [r for r in survivor.events("recovered") if r["cause"] == "node_lost"]
        with anyio.fail_after(TTL + 10):  # settled once the 1 s bound passed
            while not lost():
                await anyio.sleep(0.1)  # the event log is a file: no change notification
        (rec,) = lost()
        # the fake workers post no progress: when the survivor resumed is not seen
        assert rec["recovered"] == "unknown" and rec["phases"]["resume"] == "unknown"
        assert "local_rank" not in rec and rec["failed_attempt"] == attempt  # None: not logged
        assert rec["no_signal"] == [0, 1]  # the fake workers post no progress at all
        # the victim's key went with its lease; the survivor's follows its new attempt
        # (written at most once a second)
        rows = await wait_summaries(client, job.run_id, lambda r: len(r) == 1
                                    and r[0]["attempt"] == attempt + 1
                                    and r[0]["state"] == "running")
        assert rows[0]["node_id"] != victim_id
