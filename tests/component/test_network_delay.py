"""The lab's delay fault (tests/support/netlab.py ``delay``, tests/support/netdelay.py):
packets between two of its hosts are really held, clearing lets them pass again, a cut
still drops delayed traffic, and no delayer outlives its lab, also when the lab's process
is SIGKILLed.

A TCP connect to a port nobody listens on is answered by a RST (``netlab.round_trip``): it
takes exactly one round trip, SYN one way and RST the other, so its time is at least the
sum of the two delays (a lower bound: the delayer never passes a packet early). Root,
``ip netns``, iptables (legacy) and fnfqueue are needed (skipped with the reason otherwise).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

import pytest

from tests.support import deps
from tests.support.netlab import (
    NetLab,
    delay_unavailable,
    namespaces,
    round_trip,
    sweep_stale,
)
from tests.support.netlab import unavailable as lab_unavailable
from tests.support.paths import REPO
from tests.support.processes import pid_alive, wait_dead

ONE_WAY = 0.2  # seconds each way
# the lab's own process for the SIGKILL test: a lab with a delay, then wait to be killed
_OWNER = ("import sys\n"
          "from tests.support.netlab import NetLab\n"
          "lab = NetLab().__enter__()\n"
          "a, b = lab.host('a'), lab.host('b')\n"
          "lab.delay(a, b, 100)\n"
          "print(lab.delayers()[0].proc.pid, lab.switch, flush=True)\n"
          "sys.stdin.read()\n")


@pytest.fixture(autouse=True)
def _delay_available() -> None:
    reason = lab_unavailable() or delay_unavailable()
    if reason is not None:
        deps.missing(reason)


def test_a_round_trip_across_a_delayed_link_takes_at_least_both_delays() -> None:
    with NetLab() as lab:
        a, b = lab.host("a"), lab.host("b")
        lab.delay(a, b, ONE_WAY * 1000)
        lab.delay(b, a, ONE_WAY * 1000)
        rtt = round_trip(a, b)
        assert rtt is not None and rtt >= 2 * ONE_WAY, rtt


def test_one_way_delay_holds_only_its_way() -> None:
    """A delay from b to a adds to a's round trips (the RST comes back late) and a delay
    of a different length on the way there adds its own: one delayer per length."""
    with NetLab() as lab:
        a, b = lab.host("a"), lab.host("b")
        lab.delay(b, a, ONE_WAY * 1000)
        rtt = round_trip(a, b)
        assert rtt is not None and rtt >= ONE_WAY, rtt
        lab.delay(a, b, 2 * ONE_WAY * 1000)
        assert len(lab.delayers()) == 2
        rtt = round_trip(a, b)
        assert rtt is not None and rtt >= 3 * ONE_WAY, rtt


def test_a_cleared_delay_lets_packets_pass_at_once() -> None:
    with NetLab() as lab:
        a, b = lab.host("a"), lab.host("b")
        lab.delay(a, b, ONE_WAY * 1000)
        lab.delay(b, a, ONE_WAY * 1000)
        lab.clear_delay(a, b)
        lab.clear_delay(b, a)
        assert lab.delayers() == []  # the last pair's delayer stopped, exit 0
        rtt = round_trip(a, b)
        assert rtt is not None and rtt < ONE_WAY, rtt  # a veth round trip: milliseconds


def test_a_cut_drops_delayed_traffic_too() -> None:
    """The cut acts before the delay (nftables ahead of br_netfilter): nothing comes
    back, late or not."""
    with NetLab() as lab:
        a, b = lab.host("a"), lab.host("b")
        lab.delay(a, b, ONE_WAY * 1000)
        lab.delay(b, a, ONE_WAY * 1000)
        lab.cut(a, b)
        assert round_trip(a, b) is None


async def test_no_delayer_outlives_its_lab() -> None:
    with NetLab() as lab:
        a, b = lab.host("a"), lab.host("b")
        lab.delay(a, b, ONE_WAY * 1000)
        pids = [d.proc.pid for d in lab.delayers()]
        made = [ns for ns in namespaces() if ns.startswith(lab.switch.removesuffix("sw"))]
        assert all(pid_alive(p) for p in pids) and len(made) == 3
    await wait_dead(pids, timeout=10)
    assert not set(made) & set(namespaces())


async def test_a_delayer_dies_when_its_labs_process_is_sigkilled() -> None:
    """No atexit, no close: the delayer's stdin, the lab's pipe, reaches its end of file;
    the lab's namespaces are swept by the next lab (``sweep_stale``)."""
    owner = subprocess.Popen([sys.executable, "-c", _OWNER], cwd=REPO, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert owner.stdout is not None
        assert select.select([owner.stdout], [], [], 30)[0], "the lab's process said nothing"
        pid, switch = owner.stdout.readline().decode().split()
        assert pid_alive(int(pid))
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=10)
    finally:
        owner.kill()
        owner.communicate(timeout=10)
    await wait_dead([int(pid)], timeout=10)
    # swept here, or already by a lab another test started meanwhile (its start sweeps)
    sweep_stale()
    assert not [ns for ns in namespaces() if ns.startswith(switch.removesuffix("sw"))]
