"""The etcd client's outage bookkeeping: one outage is reported once, even when a pass that
began before another call's answer fails after it (two calls in flight as members return)."""

from __future__ import annotations

import time

import pytest

from supervisor.rendezvous.etcd.wire.client import (
    EtcdClient,
    EtcdError,
    JsonDict,
    Reachability,
    _EndpointDown,
    _raise_for_error,
)


def _client() -> tuple[EtcdClient, list[bool]]:
    heard: list[bool] = []

    def hook(reachable: bool, _state: Reachability) -> None:
        heard.append(reachable)

    return EtcdClient(["http://127.0.0.1:1"], on_reachability=hook), heard


def test_a_failed_pass_that_began_before_an_answer_starts_no_outage() -> None:
    client, heard = _client()
    began = time.monotonic()
    client._reached()  # another call is answered while this pass still waits
    client._unreached("http://127.0.0.1:1: TimeoutError", began)
    assert client.reachability.unreachable_since is None
    assert client.reachability.outages == 0 and heard == []
    assert client.stats.retry_passes == 1  # counted all the same


def test_a_failed_pass_that_began_after_the_last_answer_starts_one() -> None:
    client, heard = _client()
    client._reached()
    began = time.monotonic()
    client._unreached("refused", began)
    client._unreached("refused", time.monotonic())  # the same outage, extended
    assert client.reachability.unreachable_since is not None
    assert client.reachability.outages == 1 and heard == [False]
    client._reached()
    assert heard == [False, True]


def test_during_an_outage_a_stale_pass_changes_nothing() -> None:
    client, heard = _client()
    client._unreached("refused", time.monotonic())
    stale = time.monotonic()
    client._reached()  # the outage ends
    client._unreached("timeout", stale)  # a pass older than that answer
    assert client.reachability.unreachable_since is None and heard == [False, True]


# the JSON gateway's answers while its member stops gracefully (etcd 3.4, observed by a
# request loop against a member given SIGTERM): not etcd's verdict, ask another member
@pytest.mark.parametrize("body", [
    {"error": "OK: HTTP status code 200; transport: missing content-type field",
     "message": "OK: HTTP status code 200; transport: missing content-type field", "code": 2},
    {"error": "server closed the stream without sending trailers",
     "message": "server closed the stream without sending trailers", "code": 13},
    {"error": {"grpc_code": 1, "message": "grpc: the client connection is closing"}},
])
def test_a_stopping_members_gateway_errors_send_the_request_elsewhere(body: JsonDict) -> None:
    with pytest.raises(_EndpointDown):
        _raise_for_error(body)


def test_etcds_own_errors_are_not_retried_elsewhere() -> None:
    with pytest.raises(EtcdError):
        _raise_for_error({"error": "etcdserver: request is too large",
                          "message": "etcdserver: request is too large", "code": 3})
    with pytest.raises(EtcdError):
        _raise_for_error({"error": "unknown thing", "message": "unknown thing", "code": 2})
