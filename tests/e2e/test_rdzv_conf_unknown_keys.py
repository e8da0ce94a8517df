"""Unknown ``--rdzv-conf`` keys are ignored with one warning, as torchrun ignores them;
quotes a shell did not remove are stripped; a known key's bad value stays an error."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.rendezvous.c10d.config import make_c10d_config
from supervisor.rendezvous.conf import RendezvousConfigError, read_conf, unquote
from supervisor.rendezvous.etcd.config import parse_rdzv_conf
from tests.support.etcd import etcd_binary
from tests.support.ports import free_port

PYTORCH_CONF = "'join_timeout=5,last_call_timeout=1,timeout=5'"  # test_run.py's, quotes in


def test_unquote_strips_one_matching_pair_only() -> None:
    assert unquote("'a=1'") == ("a=1", True)
    assert unquote('"a=1"') == ("a=1", True)
    assert unquote("'a=1\"") == ("'a=1\"", False)
    assert unquote("a='1'") == ("a='1'", False)


def test_unknown_keys_are_dropped_with_a_warning_naming_them_and_the_known_keys() -> None:
    read = read_conf("bogus=1,join_timeout=5", ("join_timeout", "timeout"), "etcd")
    assert read.items == (("join_timeout", "5"),)
    assert read.warnings == ("--rdzv-conf: unknown key 'bogus' for etcd ignored, as torchrun "
                             "does (known: join_timeout, timeout)",)


def test_a_quoted_value_is_read_whole_and_the_warning_says_so() -> None:
    read = read_conf(PYTORCH_CONF, ("join_timeout", "last_call_timeout", "timeout"), "c10d")
    assert read.text == "join_timeout=5,last_call_timeout=1,timeout=5"
    assert len(read.warnings) == 1 and "removed the quotes" in read.warnings[0]


def test_etcd_backend_continues_past_an_unknown_key(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        conf = parse_rdzv_conf("join_timeout=7,typo_timeout=3")
    assert conf == {"join_timeout": 7.0}
    assert [r.getMessage() for r in caplog.records if "typo_timeout" in r.getMessage()]


def test_c10d_takes_pytorchs_quoted_conf(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        config = make_c10d_config(endpoint="localhost:0", run_id="j", nnodes="1",
                                  rdzv_conf=PYTORCH_CONF)
    assert (config.etcd.join_timeout, config.etcd.last_call_timeout) == (5.0, 1.0)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "removed the quotes" in warnings[0]


@pytest.mark.parametrize("conf", ["join_timeout=soon", "'last_call_timeout=-1'", "lease_ttl",
                                  "'lease_ttl=x'", "'typo=1,lease_ttl=0'"])
@pytest.mark.parametrize("backend", ["c10d", "etcd"])
def test_a_known_key_with_a_bad_value_is_still_an_error_and_the_only_line(
    conf: str, backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A bad value ends the start with one line: no warning about the quotes or an unknown
    key before it (a fuzzed command line found the warning printed first)."""
    with caplog.at_level(logging.WARNING), pytest.raises(RendezvousConfigError):
        if backend == "c10d":
            make_c10d_config(endpoint="localhost", run_id="j", nnodes="2", rdzv_conf=conf)
        else:
            parse_rdzv_conf(conf)
    assert caplog.records == []


@pytest.mark.etcd
def test_pytorchs_launch_elastic_command_line_runs(tmp_path: Path) -> None:
    """test_run.py::test_launch_elastic, one node of 1:2, its quoted conf as one argument."""
    etcd_binary()
    done = tmp_path / "done"
    done.mkdir()
    script = "import os, sys; open(os.path.join(sys.argv[1], os.environ['RANK']), 'w').close()"
    result = subprocess.run(
        [sys.executable, "-m", "supervisor", "run", "--nnodes=1:2", "--nproc-per-node=2",
         "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{free_port()}",
         f"--rdzv-conf={PYTORCH_CONF}", "--rdzv-id=quoted", "--monitor-interval=1",
         "--health-port=0", f"--log-dir={tmp_path / 'logs'}",
         "--no-python", sys.executable, "-c", script, str(done)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in done.iterdir()) == ["0", "1"]
    assert "removed the quotes" in result.stderr


@pytest.mark.parametrize(("key", "ours"), [("ssl_cert", "cert"), ("ca_cert", "cacert"),
                                           ("ssl_cert_key", "key")])
def test_torchs_etcd_v2_tls_names_are_refused_not_ignored(key: str, ours: str) -> None:
    with pytest.raises(RendezvousConfigError, match=f"{key} is torch's etcd-v2 name; here it "
                                                    f"is {ours}"):
        parse_rdzv_conf(f"{key}=/etc/x.pem")
