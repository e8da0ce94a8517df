"""Issue 17: torchrun's multi-node command lines, ``--rdzv-backend c10d`` (and etcd, etcd-v2).

The end-to-end tests start real supervisors on this machine with the c10d command line as
torchrun's documentation writes it; the supervisor whose endpoint is this machine and whose
etcd binds the port hosts a real etcd child, the others join it. They synchronise on output
lines (workers print ``env ...``; supervisors log ``started etcd (pid N)`` and ``this node
hosts``) and every process any node started, workers and etcd children, must be gone at
the end.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import anyio
import pytest

from supervisor.cli import parse_run_args
from supervisor.config import ConfigError
from supervisor.rendezvous.c10d.backend import C10dRendezvous
from supervisor.rendezvous.c10d.config import DEFAULT_PORT, make_c10d_config, parse_endpoint
from supervisor.rendezvous.c10d.host import matches_this_machine
from supervisor.rendezvous.etcd.config import RendezvousConfigError, make_config
from supervisor.rendezvous.registry import make_rendezvous
from supervisor.rendezvous.static import StaticRendezvous
from supervisor.startup import resolve_run_id
from tests.support.daemon import supervisor
from tests.support.etcd import etcd_binary
from tests.support.nodes import LOCAL, SHOWN, Env, Node, assert_one_group, stop_all
from tests.support.paths import FAKE_WORKER, REPO, WORKERS
from tests.support.ports import free_port
from tests.support.processes import wait_dead
from tests.support.torchref import FINAL, STEPS, torchrun_final_loss
from tests.support.torchrun_lines import command_lines

etcd = pytest.mark.etcd
READ_TIMEOUT = 2  # --rdzv-conf read_timeout of the host-loss test: its outage_limit
LEASE_TTL = 10  # the default
# docs/rendezvous.md: a node notices a lost host within outage_limit plus one keepalive
# interval (lease TTL / 3), then stops its workers (grace: --shutdown-timeout, 5 s here)
# and exits; the margin is for this shared 2-core machine.
HOST_LOSS_BOUND = READ_TIMEOUT + LEASE_TTL / 3 + 5 + 5


def dash_line(run_id: str, nnodes: str, endpoint: str) -> list[str]:
    """torchrun's documented line, dash spelling."""
    return [f"--nnodes={nnodes}", f"--nproc-per-node={LOCAL}", f"--rdzv-id={run_id}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}"]


def underscore_line(run_id: str, nnodes: str, endpoint: str) -> list[str]:
    """The same line as the older tutorials spell it."""
    return ["--nnodes", nnodes, "--nproc_per_node", str(LOCAL), "--rdzv_id", run_id,
            "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint]


class C10dJob:
    """Supervisors of one c10d job on this machine."""

    def __init__(self, stack: AsyncExitStack, root: Path) -> None:
        self.stack = stack
        self.root = root
        self.run_id = f"c10d-{uuid.uuid4().hex[:10]}"
        self.port = free_port()
        self.nodes: list[Node] = []

    async def start(self, line: list[str], *, conf: str = "", worker: Sequence[str] = ("--hang",),
                    script: Sequence[str] | None = None, flags: Sequence[str] = ()) -> Node:
        log_dir = self.root / f"node{len(self.nodes)}"
        ours = ["--health-port", "0", "--log-dir", str(log_dir), "--shutdown-timeout", "5",
                *flags]
        if conf:
            ours += ["--rdzv-conf", conf]
        program = list(script) if script is not None else [FAKE_WORKER, "--print-env", SHOWN,
                                                           *worker]
        spawned = time.monotonic()
        sup = await self.stack.enter_async_context(supervisor([*line, *ours, *program]))
        node = Node(sup, log_dir, self.run_id, spawned)
        self.nodes.append(node)
        return node

    def etcd_pids(self) -> set[int]:
        """Every etcd child any node started (also those that lost the race to bind)."""
        return {int(m[1]) for node in self.nodes for line in node.sup.err.lines
                if (m := re.search(r"started etcd \(pid (\d+)\)", line))}

    def hosts(self) -> list[Node]:
        return [n for n in self.nodes if "this node hosts the rendezvous" in n.sup.err.text()]

    def pids(self) -> set[int]:
        return self.etcd_pids().union(*(node.worker_pids() for node in self.nodes))


@asynccontextmanager
async def c10d_job(tmp_path: Path) -> AsyncIterator[C10dJob]:
    """A job's supervisors; on exit every one still running is SIGKILLed, and every worker
    and etcd child any of them started must be gone (death signal) within 10 s."""
    etcd_binary()  # skips when etcd is not installed
    job = C10dJob(AsyncExitStack(), tmp_path)
    try:
        async with job.stack:
            yield job
    finally:
        with anyio.CancelScope(shield=True):
            await wait_dead(sorted(job.pids()), timeout=10)


async def groups(nodes: Sequence[Node], world_size: int,
                 timeout: float = 30) -> list[dict[int, Env]]:
    found: list[dict[int, Env]] = [{} for _ in nodes]

    async def one(i: int) -> None:
        found[i] = await nodes[i].group(world_size, timeout=timeout)

    async with anyio.create_task_group() as tg:
        for i in range(len(nodes)):
            tg.start_soon(one, i)
    return found


# ---------------------------------------------------------------------- formation


@etcd
@pytest.mark.parametrize("host", ["localhost", socket.gethostname()])
async def test_two_nodes_on_torchruns_dash_line_form_one_group(tmp_path: Path, host: str) -> None:
    async with c10d_job(tmp_path) as job:
        line = dash_line(job.run_id, "2", f"{host}:{job.port}")
        nodes = [await job.start(line) for _ in range(2)]
        assert_one_group(await groups(nodes, 2 * LOCAL), 2)
        assert len(job.hosts()) == 1
        await stop_all(nodes)
        await wait_dead(sorted(job.etcd_pids()), timeout=10)  # stopped with its supervisor


@etcd
async def test_three_nodes_on_the_underscore_line_with_127_0_0_1_succeed_together(
        tmp_path: Path) -> None:
    async with c10d_job(tmp_path) as job:
        line = underscore_line(job.run_id, "3", f"127.0.0.1:{job.port}")
        nodes = [await job.start(line, worker=()) for _ in range(3)]  # workers exit 0
        assert_one_group(await groups(nodes, 3 * LOCAL), 3)
        codes = [await node.sup.wait(timeout=30) for node in nodes]
        assert codes == [0, 0, 0]
        assert len(job.hosts()) == 1
        for node in nodes:
            assert node.events("exit_barrier")[-1]["ok"] is True  # the host stayed for all
        await wait_dead(sorted(job.etcd_pids()), timeout=10)


@etcd
async def test_a_node_started_before_the_host_waits_for_it(tmp_path: Path) -> None:
    async with c10d_job(tmp_path) as job:
        line = dash_line(job.run_id, "2", f"localhost:{job.port}")
        early = await job.start(line, conf="is_host=0")
        await early.sup.err.expect(r"to answer: .*; retrying for \d+s more \(join_timeout",
                                   timeout=30)
        host = await job.start(line)
        assert_one_group(await groups([early, host], 2 * LOCAL), 2)
        assert job.hosts() == [host]
        await stop_all([early, host])


@etcd
async def test_scale_up_with_nnodes_2_to_3(tmp_path: Path) -> None:
    async with c10d_job(tmp_path) as job:
        line = dash_line(job.run_id, "2:3", f"localhost:{job.port}")
        first = [await job.start(line, conf="last_call_timeout=0.5") for _ in range(2)]
        assert_one_group(await groups(first, 2 * LOCAL), 2)
        await job.start(line, conf="last_call_timeout=0.5")
        assert_one_group(await groups(job.nodes, 3 * LOCAL), 3)
        for node in first:
            assert "waiting to join" in node.events("membership_changed")[-1]["reason"]
            assert not node.events("restart_scheduled")  # no budget used
        await stop_all(job.nodes)


# ---------------------------------------------------------------------- losing the host


@etcd
async def test_sigkilled_host_stops_the_other_node_within_the_bound_naming_the_host(
        tmp_path: Path) -> None:
    async with c10d_job(tmp_path) as job:
        endpoint = f"localhost:{job.port}"
        line = dash_line(job.run_id, "2", endpoint)
        conf = f"read_timeout={READ_TIMEOUT}"
        nodes = [await job.start(line, conf=conf) for _ in range(2)]
        assert_one_group(await groups(nodes, 2 * LOCAL), 2)
        (host,) = job.hosts()
        (other,) = [n for n in nodes if n is not host]
        killed = time.monotonic()
        host.sup.signal(signal.SIGKILL)
        code = None
        with anyio.move_on_after(HOST_LOSS_BOUND):
            code = await other.sup.wait(timeout=HOST_LOSS_BOUND + 5)
        took = time.monotonic() - killed
        print(f"host SIGKILLed: the other node exited {code} after {took:.3f} s")
        assert code not in (0, None)
        assert f"lost the c10d rendezvous host {endpoint}" in other.events("finished")[-1]["reason"]
        errors = [ln for ln in other.sup.err.lines if "job failed" in ln]
        assert len(errors) == 1 and f"lost the c10d rendezvous host {endpoint}" in errors[0]
        await wait_dead(sorted(job.pids()), timeout=10)  # workers of both, and the etcd child


# ---------------------------------------------------------------------- a real torch job




async def run_ddp_job(root: Path, script: Path,
                      extra: Sequence[str]) -> tuple[list[int], int, str]:
    """Two c10d supervisors, one gloo rank each; (exit codes, job-wide failure restarts,
    rank 0's final loss)."""
    async with c10d_job(root) as job:
        line = ["--nnodes=2", "--nproc-per-node=1", f"--rdzv-id={job.run_id}",
                "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{job.port}"]
        program = [str(script), *STEPS, "--checkpoint-dir", str(root / "ckpt"), *extra]
        nodes = [await job.start(line, flags=["--max-restarts", "1"],
                                 script=program) for _ in range(2)]
        codes = [await node.sup.wait(timeout=150) for node in nodes]
        finals = [ln for n in nodes for ln in n.sup.out.lines if "final loss" in ln]
        restarts = sum(len(n.events("restart_scheduled")) for n in nodes)
    assert len(finals) == 1, finals
    final = re.search(FINAL, finals[0])
    assert final, finals
    return codes, restarts, final.group(1)


@etcd
@pytest.mark.torch
@pytest.mark.xdist_group("torch")  # a training job: not beside another (test_torch_jobs.py)
@pytest.mark.timeout(400)
async def test_gloo_job_across_two_c10d_nodes_survives_an_exception_with_the_same_result(
        tmp_path: Path) -> None:
    """Rank 1 raises at step 50; the job restarts once over c10d and ends with the loss of
    the same 2 ranks under torchrun, unbroken (tests/support/torchref.py)."""
    pytest.importorskip("torch", reason="pip install torch to run the gloo job")
    codes, restarts, loss = await run_ddp_job(
        tmp_path / "faulty", WORKERS / "ddp_raise_once.py",
        ["--raise-at", "50", "--fault-rank", "1"])
    assert codes == [0, 0]
    assert restarts == 1  # the exception did happen, once
    assert loss == await anyio.to_thread.run_sync(torchrun_final_loss, tmp_path / "torchrun")


# ---------------------------------------------------------------------- bad settings


def run_line(args: Sequence[str], env: dict[str, str] | None = None,
             timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "supervisor", "run", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_missing_etcd_on_the_host_is_one_line_exit_2(tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    line = dash_line("job", "2", f"localhost:{free_port()}")
    result = run_line([*line, "--health-port", "0", "--log-dir", str(tmp_path), FAKE_WORKER],
                      env={"PATH": str(empty)})
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "etcd-server" in lines[0] and "--rdzv-backend etcd" in lines[0]


def test_unknown_backend_lists_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown backend 'zmq' \(valid: static, c10d, "
                                          r"etcd, etcd-v2\)"):
        parse_run_args(["--rdzv-backend", "zmq", "train.py"], {})


@pytest.mark.parametrize(("conf", "message"), [
    ("cacert=/x", "cacert=/x: No such file or directory"),
    ("protocol=https", "protocol is a key of --rdzv-backend etcd, not c10d"),
    ("is_host=maybe", "is_host='maybe' is not a boolean"),
    ("read_timeout=0", "read_timeout must be positive"),
    ("close_timeout=x", "close_timeout='x' is not a number"),
    ("join_timeout", "expected key=value"),
])
def test_bad_c10d_conf_is_one_line(conf: str, message: str) -> None:
    with pytest.raises(RendezvousConfigError, match=re.escape(message)):
        make_c10d_config(endpoint="localhost", run_id="j", nnodes="2", rdzv_conf=conf)


@pytest.mark.parametrize(("text", "expected"), [
    ("", ("localhost", DEFAULT_PORT)),
    ("node1", ("node1", DEFAULT_PORT)),
    ("node1.example.com:29500", ("node1.example.com", 29500)),
    ("10.0.0.1:0", ("10.0.0.1", 0)),
    ("[::1]", ("::1", DEFAULT_PORT)),
    ("[::1]:1234", ("::1", 1234)),
])
def test_endpoint_is_parsed_like_torchrun(text: str, expected: tuple[str, int]) -> None:
    assert parse_endpoint(text) == expected


@pytest.mark.parametrize("text", ["a:b", "a:70000", "a,b", "bad host:1"])
def test_bad_endpoint_is_refused(text: str) -> None:
    with pytest.raises(RendezvousConfigError, match="--rdzv-endpoint"):
        parse_endpoint(text)


def test_torchrun_conf_keys_are_mapped() -> None:
    cfg = make_c10d_config(
        endpoint="node1:29401", run_id="j", nnodes="1:4",
        rdzv_conf="join_timeout=60,last_call_timeout=2,close_timeout=7,read_timeout=9,"
                  "is_host=false")
    assert (cfg.host, cfg.port, cfg.is_host, cfg.close_timeout) == ("node1", 29401, False, 7)
    assert cfg.etcd.endpoints == ("http://node1:29401",)
    assert (cfg.etcd.join_timeout, cfg.etcd.last_call_timeout) == (60, 2)
    assert cfg.etcd.outage_limit == 9  # read_timeout bounds how long the host may be gone
    assert make_c10d_config(endpoint="n", run_id="j", nnodes="2",
                            rdzv_conf="timeout=33").etcd.join_timeout == 33


def test_c10d_always_has_a_finite_outage_limit() -> None:
    assert make_c10d_config(endpoint="n", run_id="j", nnodes="2").etcd.outage_limit == 10
    ttl = make_c10d_config(endpoint="n", run_id="j", nnodes="2", rdzv_conf="lease_ttl=4")
    assert ttl.etcd.outage_limit == 4
    given = make_c10d_config(endpoint="n", run_id="j", nnodes="2",
                             rdzv_conf="outage_limit=3,read_timeout=60")
    assert given.etcd.outage_limit == 3


def test_etcd_backend_takes_outage_limit() -> None:
    assert make_config(endpoint="e:2379", run_id="j", nnodes="2").outage_limit is None
    cfg = make_config(endpoint="e:2379", run_id="j", nnodes="2", rdzv_conf="outage_limit=4.5")
    assert cfg.outage_limit == 4.5


def test_port_0_is_for_one_node_only() -> None:
    with pytest.raises(RendezvousConfigError, match="port 0"):
        make_c10d_config(endpoint="localhost:0", run_id="j", nnodes="2")


def test_this_machine_is_recognised_as_torchrun_does() -> None:
    assert matches_this_machine("localhost")
    assert matches_this_machine("127.0.0.1") and matches_this_machine("::1")
    assert matches_this_machine(socket.gethostname())
    assert not matches_this_machine("no-such-host.invalid")
    assert not matches_this_machine("192.0.2.1")  # TEST-NET-1: never this machine's


def _backend_of(argv: Sequence[str]) -> str:
    return next((a.split("=", 1)[1] if "=" in a else argv[i + 1]
                 for i, a in enumerate(argv) if a.split("=")[0] in ("--rdzv-backend",
                                                                    "--rdzv_backend")),
                "static")


@pytest.mark.parametrize("argv", command_lines(), ids=lambda a: " ".join(a)[:60])
async def test_every_documented_torchrun_command_line_is_accepted(
        argv: list[str], tmp_path: Path) -> None:
    """Parsed, validated and given a rendezvous backend (not run, nothing is contacted)."""
    settings = parse_run_args(argv, {})
    rendezvous = make_rendezvous(settings, resolve_run_id(settings), tmp_path)
    try:
        backend = _backend_of(argv)
        single = settings.standalone or settings.rdzv_endpoint.endswith(":0")
        if backend == "c10d" and not single:
            assert isinstance(rendezvous, C10dRendezvous)
        elif backend in ("static", "c10d"):
            assert isinstance(rendezvous, StaticRendezvous)
        else:
            assert rendezvous.backend == "etcd"
    finally:
        await rendezvous.aclose()


def test_a_host_name_resolving_to_loopback_is_served_on_this_machines_addresses() -> None:
    import ipaddress

    from supervisor.rendezvous.c10d.access import interface_addresses, listen_plan

    assert listen_plan("localhost", None).ips == ("127.0.0.1",)
    assert listen_plan("127.0.0.1", None).ips == ("127.0.0.1",)
    name = socket.gethostname()
    try:
        resolved = socket.gethostbyname(name)
    except OSError:
        pytest.skip("this machine's name does not resolve")
    ips = listen_plan(name, None).ips
    assert resolved in ips
    if ipaddress.ip_address(resolved).is_loopback and interface_addresses():
        assert "0.0.0.0" not in ips  # never every interface when something narrower serves
        assert set(interface_addresses()) <= set(ips)


def test_endpoints_of_this_machine_other_than_loopback_would_host() -> None:
    """The host decision for an address of this machine (not only loopback)."""
    try:
        ip = socket.gethostbyname(socket.gethostname())
    except OSError:
        pytest.skip("this machine's name does not resolve")
    assert matches_this_machine(ip)


def test_an_etcd_that_cannot_start_is_one_line_exit_2(tmp_path: Path) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "etcd").write_text("#!/bin/sh\necho 'fatal: no space left on device' >&2\nexit 1\n")
    (fake / "etcd").chmod(0o755)
    line = dash_line("job", "2", f"127.0.0.1:{free_port()}")
    result = run_line([*line, "--health-port", "0", "--log-dir", str(tmp_path), FAKE_WORKER],
                      env={"PATH": str(fake)})
    assert result.returncode == 2
    errors = [ln for ln in result.stderr.strip().splitlines() if " INFO " not in ln]
    assert len(errors) == 1, result.stderr
    assert "exited: fatal: no space left on device" in errors[0]


def test_is_host_with_a_name_that_does_not_resolve_is_one_line_exit_2(tmp_path: Path) -> None:
    line = dash_line("job", "2", "no-such-host.invalid:29400")
    result = run_line([*line, "--rdzv-conf", "is_host=1", "--health-port", "0",
                       "--log-dir", str(tmp_path), FAKE_WORKER])
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot resolve 'no-such-host.invalid'" in lines[0], result.stderr


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_a_stop_signal_while_waiting_for_the_host_exits_cleanly(
        tmp_path: Path, signum: int) -> None:
    line = dash_line("job", "2", f"localhost:{free_port()}")
    args = [*line, "--rdzv-conf", "is_host=0,read_timeout=1", "--health-port", "0",
            "--log-dir", str(tmp_path), FAKE_WORKER]
    async with supervisor(args) as sup:
        await sup.err.expect(r"to answer: .*; retrying for \d+s more \(join_timeout",
                             timeout=30)
        sup.signal(signum)
        assert await sup.wait(timeout=15) == 128 + signum
    assert "Traceback" not in sup.err.text() and "Unclosed" not in sup.err.text()
