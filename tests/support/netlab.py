"""A network of our own for fault tests: hosts in network namespaces on one bridge.

``NetLab`` makes, for one run, a *switch* namespace holding a bridge and one namespace per
host, each joined to the bridge by a veth pair, with an address in ``10.213.<n>.0/24``.
Every namespace, interface and address is the lab's own: the root namespace is never
touched, so traffic goes only between the lab's hosts, and two labs (other sessions'
tests, or two runs at once) cannot collide even when they pick the same subnet. Names are
``esnet-<pid hex>-<random>-<label>``: unique per run; ``sweep_stale()`` removes the
namespaces of runs whose process is gone (a SIGKILLed test), and every lab removes its own
on exit, also when the test fails (``with NetLab() as lab``; plus ``atexit``).

Faults, all made inside the switch namespace so that neither end gets an error:
``link_down``/``link_up`` (the host's bridge port), ``cut(a, b)``/``heal(a, b)`` (nftables
in the bridge family drops every frame between two addresses, both ways), ``lossy(a, b,
percent)`` (random drops, nftables ``numgen``), ``delay(a, b, ms)``/``clear_delay(a, b)``
(every IPv4 packet from ``a`` to ``b`` held ``ms`` ms: one way, so an RTT of 200 ms is 100
ms each way).

Delay is a substitute for netem: this kernel has no ``sch_netem`` (``tc qdisc add ...
netem`` fails: "Specified qdisc kind is unknown") and no nft ``queue`` statement
(``CONFIG_NFT_QUEUE``). The bridge hands the frames it forwards to the switch's iptables
(br_netfilter), where a legacy iptables rule in ``FORWARD`` sends those from ``a`` to ``b``
to an nfnetlink queue; a delayer the lab starts in the switch namespace
(``tests/support/netdelay.py``, ``fnfqueue``) holds each packet and passes it when due.
One delayer per delay value (its queue serves every pair with that delay), stopped when
its last pair is cleared; it ends when the lab's pipe to it closes, so it dies with the
lab's process too. Cuts and random loss act before the delay (the nft chain runs at a
priority before br_netfilter's), as netem's loss acts on entry. Unlike netem: no jitter,
no rate, IPv4 only (ARP is not delayed), and a packet is held by the delayer process, so a
stopped or starved delayer delays more (never less). ``delay_unavailable()`` says what is
missing for it (iptables, fnfqueue).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "esnet"
TABLE = "esnet"
IPTABLES = "iptables-legacy"  # nft's `queue` is not built in here; xt NFQUEUE is
DELAYER = Path(__file__).with_name("netdelay.py")
DELAYER_READY = 10.0  # seconds for a delayer to bind its queue
# br_netfilter's hooks run at bridge priority 0 (NF_BR_PRI_BRNF): ours run first, so a
# cut or a loss drops a frame before it is queued for a delay
NFT_PRIORITY = -1
_NAME = re.compile(rf"^{PREFIX}-([0-9a-f]+)-[0-9a-f]+-")


def unavailable() -> str | None:
    """Why network namespaces cannot be used here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (run the tests as root, as .ci/run does)"
    for tool, package in (("ip", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            return f"{tool} is not on PATH; apt-get install {package} (.ci/run does)"
    probe = f"{PREFIX}-probe-{os.getpid():x}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def delay_unavailable() -> str | None:
    """Why ``NetLab.delay`` cannot work here (None: it can), on top of ``unavailable()``."""
    how = "apt-get install iptables; pip install fnfqueue (.ci/run does)"
    if shutil.which(IPTABLES) is None:
        return f"{IPTABLES} is not on PATH; {how}"
    probe = subprocess.run([sys.executable, "-c", "import fnfqueue"], capture_output=True,
                           text=True)
    if probe.returncode != 0:
        return f"{sys.executable} cannot import fnfqueue; {how}"
    if not Path("/proc/sys/net/bridge/bridge-nf-call-iptables").exists():
        return "no br_netfilter in this kernel (modprobe br_netfilter)"
    return None


# one TCP round trip: a connect's time (a RST from a closed port also ends it), "timeout"
_CONNECT = ("import socket, sys, time\n"
            "start = time.monotonic()\n"
            "try:\n"
            "    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close()\n"
            "except ConnectionRefusedError:\n    pass\n"
            "except TimeoutError:\n    print('timeout'); sys.exit()\n"
            "print(time.monotonic() - start)\n")


def round_trip(src: Host, dst: Host, port: int = 9) -> float | None:
    """One TCP round trip from ``src`` to ``dst`` in seconds, measured inside ``src``'s
    namespace: a connect to ``port``, answered by a SYN-ACK, or by a RST where nobody
    listens (the default, the discard port), the SYN one way and the answer the other.
    None: no answer within 2 s."""
    done = subprocess.run(["ip", "netns", "exec", src.ns, sys.executable, "-c", _CONNECT,
                           dst.addr, str(port)], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"round trip from {src.label}: {done.stderr.strip()}")
    out = done.stdout.strip()
    return None if out == "timeout" else float(out)


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _in(ns: str, *argv: str, check: bool = True) -> str:
    done = subprocess.run(["ip", "netns", "exec", ns, *argv], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} in {ns}: {done.stderr.strip()}")
    return done.stdout


def namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def sweep_stale() -> list[str]:
    """Delete the namespaces of labs whose process is gone; the names deleted."""
    removed = []
    for ns in namespaces():
        match = _NAME.match(ns)
        if match is None:
            continue
        pid = int(match[1], 16)
        try:
            os.kill(pid, 0)
            continue  # its run is alive: not ours to touch
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        removed.append(ns)
    return removed


@dataclass(frozen=True)
class Host:
    """One namespace on the bridge."""

    label: str
    ns: str
    addr: str
    port: str  # its bridge port (in the switch namespace)


@dataclass
class Delayer:
    """A delayer process in the switch namespace, reading one queue (see netdelay.py)."""

    queue: int
    ms: float
    proc: subprocess.Popen[bytes]
    pairs: set[tuple[str, str]] = field(default_factory=set)


@dataclass
class NetLab:
    """The switch, the hosts and the processes of one run (see the module docstring)."""

    subnet: int = field(default_factory=lambda: random.randrange(1, 255))
    token: str = field(default_factory=lambda: f"{os.getpid():x}-{random.getrandbits(24):06x}")
    hosts: dict[str, Host] = field(default_factory=dict)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _made: list[str] = field(default_factory=list)
    _loss: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    _delayers: dict[float, Delayer] = field(default_factory=dict)
    _delays: dict[tuple[str, str], float] = field(default_factory=dict)
    _queues: int = 0

    def __post_init__(self) -> None:
        self.switch = f"{PREFIX}-{self.token}-sw"

    def __enter__(self) -> NetLab:
        sweep_stale()
        atexit.register(self.close)
        try:
            self._make_switch()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _make_switch(self) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        rules = (f"table bridge {TABLE} {{\n"
                 "  set cut { type ipv4_addr . ipv4_addr; }\n"
                 "  chain passing { type filter hook forward"
                 f" priority {NFT_PRIORITY}; policy accept;\n"
                 "    ip saddr . ip daddr @cut drop\n  }\n}\n")
        done = subprocess.run(["ip", "netns", "exec", self.switch, "nft", "-f", "-"],
                              input=rules, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"nft in {self.switch}: {done.stderr.strip()}")

    def host(self, label: str) -> Host:
        """A new namespace on the bridge with the next address."""
        ns = f"{PREFIX}-{self.token}-{label}"
        addr = f"10.213.{self.subnet}.{len(self.hosts) + 10}"
        port = f"p{len(self.hosts)}"
        _ip("netns", "add", ns)
        self._made.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0",
            "netns", ns)
        _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
        _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        host = Host(label, ns, addr, port)
        self.hosts[label] = host
        return host

    def spawn(self, host: Host, argv: Sequence[str], **popen: object
              ) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside ``host``'s namespace (``ip netns exec`` execs it: the pid is
        the program's own). Killed by ``close``."""
        proc: subprocess.Popen[bytes] = subprocess.Popen(
            ["ip", "netns", "exec", host.ns, *argv], **popen)  # type: ignore[call-overload]
        self.procs.append(proc)
        return proc

    # faults

    def link_down(self, host: Host) -> None:
        _ip("-n", self.switch, "link", "set", host.port, "down")

    def link_up(self, host: Host) -> None:
        _ip("-n", self.switch, "link", "set", host.port, "up")

    def _elements(self, a: Host, b: Host) -> str:
        return f"{{ {a.addr} . {b.addr}, {b.addr} . {a.addr} }}"

    def cut(self, a: Host, b: Host) -> None:
        """Drop every frame between ``a`` and ``b`` (both ways), silently."""
        _in(self.switch, "nft", "add", "element", "bridge", TABLE, "cut", self._elements(a, b))

    def heal(self, a: Host, b: Host) -> None:
        _in(self.switch, "nft", "delete", "element", "bridge", TABLE, "cut",
            self._elements(a, b))

    def lossy(self, a: Host, b: Host, percent: int) -> None:
        """Drop ``percent`` % of the frames between ``a`` and ``b``, at random."""
        handles = []
        for src, dst in ((a, b), (b, a)):
            out = _in(self.switch, "nft", "--echo", "--handle", "add", "rule", "bridge", TABLE,
                      "passing", "ip", "saddr", src.addr, "ip", "daddr", dst.addr, "numgen",
                      "random", "mod", "100", "<", str(percent), "drop")
            found = re.search(r"# handle (\d+)", out)
            if found:
                handles.append(found[1])
        self._loss[(a.addr, b.addr)] = handles

    def clear_loss(self, a: Host, b: Host) -> None:
        for handle in self._loss.pop((a.addr, b.addr), []):
            _in(self.switch, "nft", "delete", "rule", "bridge", TABLE, "passing", "handle", handle)

    def delay(self, a: Host, b: Host, ms: float) -> None:
        """Hold every IPv4 packet from ``a`` to ``b`` for ``ms`` ms (one way: the RTT
        between them is the sum of both ways), replacing any delay of that way."""
        self.clear_delay(a, b)
        delayer = self._delayers.get(ms) or self._start_delayer(ms)
        if delayer.proc.poll() is not None:  # its queue would drop everything: say so
            raise RuntimeError(f"the {ms:g} ms delayer exited ({delayer.proc.returncode})")
        _in(self.switch, IPTABLES, "-w", "-A", "FORWARD", *self._queued(a, b, delayer))
        delayer.pairs.add((a.addr, b.addr))
        self._delays[(a.addr, b.addr)] = ms

    def clear_delay(self, a: Host, b: Host) -> None:
        """Packets from ``a`` to ``b`` pass at once again (those held go when due); a
        delayer that died meanwhile is reported here, once its rules are gone."""
        ms = self._delays.pop((a.addr, b.addr), None)
        if ms is None:
            return
        delayer = self._delayers[ms]
        _in(self.switch, IPTABLES, "-w", "-D", "FORWARD", *self._queued(a, b, delayer))
        delayer.pairs.discard((a.addr, b.addr))
        if not delayer.pairs:
            self._stop_delayer(delayer)

    def delayers(self) -> list[Delayer]:
        """The delayer processes running now."""
        return list(self._delayers.values())

    @staticmethod
    def _queued(a: Host, b: Host, delayer: Delayer) -> list[str]:
        return ["-s", a.addr, "-d", b.addr, "-j", "NFQUEUE", "--queue-num", str(delayer.queue)]

    def _start_delayer(self, ms: float) -> Delayer:
        if not self._delayers:  # the bridge's frames through iptables (it is per namespace)
            _in(self.switch, "sh", "-c", "echo 1 > /proc/sys/net/bridge/bridge-nf-call-iptables")
        self._queues += 1
        # stdin is our pipe: its end of file stops the delayer, also when this process dies
        proc: subprocess.Popen[bytes] = subprocess.Popen(
            ["ip", "netns", "exec", self.switch, sys.executable, str(DELAYER),
             "--queue", str(self._queues), "--delay-ms", str(ms)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], DELAYER_READY)
        line = proc.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            rest = self._stop_delayer_now(proc)
            raise RuntimeError(f"the delayer did not start: {(line + rest).decode().strip()}")
        delayer = Delayer(self._queues, ms, proc)
        self._delayers[ms] = delayer
        return delayer

    def _stop_delayer(self, delayer: Delayer) -> None:
        """Close its pipe: it passes what it holds when due, then exits."""
        del self._delayers[delayer.ms]
        try:
            out, _ = delayer.proc.communicate(timeout=delayer.ms / 1000 + 10)
        except subprocess.TimeoutExpired:
            self._stop_delayer_now(delayer.proc)
            raise RuntimeError(f"the {delayer.ms:g} ms delayer did not stop") from None
        if delayer.proc.returncode != 0:
            raise RuntimeError(f"the {delayer.ms:g} ms delayer failed "
                               f"({delayer.proc.returncode}): {out.decode().strip()}")

    @staticmethod
    def _stop_delayer_now(proc: subprocess.Popen[bytes]) -> bytes:
        """SIGKILL it; what it wrote."""
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            return proc.communicate(timeout=5)[0] or b""
        return b""

    # the end

    def close(self) -> None:
        """Kill every process started here, then delete every namespace made here."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 10
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
        self.procs.clear()
        self._delayers.clear()
        self._delays.clear()
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()
