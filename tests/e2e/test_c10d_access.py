"""The c10d host's etcd is not open to whoever reaches it (issue 25, findings 1 and 2).

Real supervisors host a real etcd with the c10d command line. With ``cacert``/``cert``/
``key`` in ``--rdzv-conf`` the hosted etcd requires client certificates: a client without
one, or with one another CA signed, is refused; the job runs with the right ones; with
``user``/``password_file`` on top, a certificate alone is not enough. A certificate
without its key is exit 2 with one line. Without credentials the host warns that the
rendezvous is open. A port that another user listens on first is not joined.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import anyio
import pytest

from supervisor.rendezvous.c10d.access import check_port_owner, port_owners
from supervisor.rendezvous.etcd.keys import Keys
from supervisor.rendezvous.etcd.wire.client import EtcdClient, EtcdError, TlsFiles
from tests.support.daemon import Supervised, supervisor
from tests.support.etcd import TlsMaterial, etcd_binary, make_tls_material
from tests.support.paths import FAKE_WORKER, TESTS
from tests.support.ports import free_port

pytestmark = pytest.mark.etcd
NOBODY = 65534
LISTENER = TESTS / "workers" / "listen_port.py"


def _line(run_id: str, port: int, log_dir: Path, conf: str, nnodes: str = "2") -> list[str]:
    line = ["--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id, "--health-port", "0",
            "--log-dir", str(log_dir), "--shutdown-timeout", "5", "--rdzv-conf",
            f"last_call_timeout=1,{conf}" if conf else "last_call_timeout=1"]
    return [*line, FAKE_WORKER, "--print-env", "RANK,MASTER_ADDR", "--hang"]


def _tls_conf(tls: TlsMaterial) -> str:
    return f"cacert={tls.ca},cert={tls.client_cert},key={tls.client_key}"


@asynccontextmanager
async def _job(tmp_path: Path, conf: str, nnodes: str = "2"
               ) -> AsyncIterator[tuple[list[Supervised], int, str]]:
    """``nnodes`` supervisors of one c10d job on 127.0.0.1, every worker up; SIGTERM and
    a clean exit for each at the end."""
    etcd_binary()
    run_id, port = f"acc-{uuid.uuid4().hex[:8]}", free_port()
    async with AsyncExitStack() as stack:
        host = await stack.enter_async_context(
            supervisor(_line(run_id, port, tmp_path / "n0", conf, nnodes)))
        await host.err.expect("this node hosts the rendezvous", timeout=30)
        nodes = [host]
        if nnodes == "2":
            nodes.append(await stack.enter_async_context(
                supervisor(_line(run_id, port, tmp_path / "n1", conf))))
        for sup in nodes:
            await sup.out.expect(r"^ready ", timeout=30)
        yield nodes, port, run_id
        for sup in reversed(nodes):
            sup.signal(signal.SIGTERM)
        for sup in reversed(nodes):
            assert await sup.wait(30) == 128 + signal.SIGTERM


async def _can_read(endpoint: str, tls: TlsFiles | None, **auth: str) -> bool:
    try:
        async with EtcdClient([endpoint], timeout=2, tls=tls, **auth) as client:
            await client.get(Keys("x").round)
    except EtcdError:
        return False
    return True


async def test_a_tls_c10d_job_refuses_clients_without_the_right_certificate(
    tmp_path: Path
) -> None:
    tls = make_tls_material(tmp_path / "tls")
    stranger = make_tls_material(tmp_path / "stranger")  # another CA signed its client cert
    async with _job(tmp_path, _tls_conf(tls)) as (nodes, port, _):
        assert {line for sup in nodes for line in sup.out.lines if line.startswith("env")} \
            == {"env RANK=0 MASTER_ADDR=127.0.0.1", "env RANK=1 MASTER_ADDR=127.0.0.1"}
        https = f"https://127.0.0.1:{port}"
        assert await _can_read(https, TlsFiles(str(tls.ca), str(tls.client_cert),
                                               str(tls.client_key)))
        assert not await _can_read(f"http://127.0.0.1:{port}", None)
        assert not await _can_read(https, TlsFiles(cacert=str(tls.ca)))  # no client cert
        assert not await _can_read(https, TlsFiles(str(tls.ca), str(stranger.client_cert),
                                                   str(stranger.client_key)))
        assert "has no authentication" not in nodes[0].err.text()


async def test_user_auth_on_top_refuses_a_certificate_without_the_password(
    tmp_path: Path
) -> None:
    tls = make_tls_material(tmp_path / "tls", common_names=False)
    secret = tmp_path / "pw"
    secret.write_text("s3cret\n")
    conf = f"{_tls_conf(tls)},user=trainer,password_file={secret}"
    async with _job(tmp_path, conf, nnodes="1") as (nodes, port, _):
        assert "etcd user auth enabled for user trainer" in nodes[0].err.text()
        files = TlsFiles(str(tls.ca), str(tls.client_cert), str(tls.client_key))
        https = f"https://127.0.0.1:{port}"
        assert not await _can_read(https, files)  # a certificate alone names no user
        assert not await _can_read(https, files, user="trainer", password="wrong")
        assert await _can_read(https, files, user="trainer", password="s3cret")
        assert "s3cret" not in nodes[0].err.text()


async def test_user_auth_with_certificates_that_carry_a_common_name_is_one_line(
    tmp_path: Path
) -> None:
    etcd_binary()
    tls = make_tls_material(tmp_path / "tls")  # CN=client: etcd's gateway refuses it
    secret = tmp_path / "pw"
    secret.write_text("s3cret\n")
    conf = f"{_tls_conf(tls)},user=trainer,password_file={secret}"
    result = await anyio.run_process(
        [sys.executable, "-m", "supervisor", "run",
         *_line("j", free_port(), tmp_path / "logs", conf, nnodes="1")], check=False)
    err = result.stderr.decode()
    assert result.returncode == 2, err
    assert "use certificates without a CN" in err.strip().splitlines()[-1]
    assert "Traceback" not in err and "s3cret" not in err


async def test_without_credentials_the_host_warns_once_that_the_rendezvous_is_open(
    tmp_path: Path
) -> None:
    async with _job(tmp_path, "", nnodes="1") as (nodes, _port, _):
        log = nodes[0].err.text()
        assert log.count("has no authentication") == 1, log
        assert "binds 127.0.0.1 (the endpoint's address)" in log, log


@pytest.mark.parametrize(("conf", "message"), [
    ("cert={crt}", "cert= needs key="),
    ("key={key}", "key= needs cert="),
    ("cert={crt},key={key}", "c10d with TLS needs cacert=, cert= and key="),
    ("cacert={ca},cert={crt},key={key},user=u", "c10d user= needs password_file="),
    ("user=u,password_file={ca}", "c10d user= needs TLS"),
])
async def test_incomplete_credentials_are_exit_2_with_one_line(
    tmp_path: Path, conf: str, message: str
) -> None:
    tls = make_tls_material(tmp_path / "tls")
    conf = conf.format(ca=tls.ca, crt=tls.client_cert, key=tls.client_key)
    result = await anyio.run_process(
        [sys.executable, "-m", "supervisor", "run",
         *_line("j", free_port(), tmp_path / "logs", conf, nnodes="1")], check=False)
    lines = result.stderr.decode().strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, lines
    assert message in lines[0] and "Traceback" not in lines[0]


def test_port_owners_reads_the_listening_socket_uid(tmp_path: Path) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert port_owners(port) == {os.geteuid()}
        check_port_owner(f"127.0.0.1:{port}", port)  # ours: no error
    assert port_owners(port) == set()


async def test_a_port_another_user_listens_on_is_not_joined(tmp_path: Path) -> None:
    etcd_binary()
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and util-linux setpriv to listen as nobody")
    port = free_port()
    with subprocess.Popen(
        ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups", "--",
         sys.executable, "-I", "-S", "-c", LISTENER.read_text(), str(port)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    ) as listener:
        try:
            assert listener.stdout is not None
            assert listener.stdout.readline() == b"listening\n"
            result = await anyio.run_process(
                [sys.executable, "-m", "supervisor", "run",
                 *_line("j", port, tmp_path / "logs", "join_timeout=5", nnodes="1")],
                check=False)
        finally:
            listener.kill()
    err = result.stderr.decode()
    assert result.returncode == 2, err
    assert f"held by uid {NOBODY}" in err and "refusing to join" in err, err
    assert "Traceback" not in err
