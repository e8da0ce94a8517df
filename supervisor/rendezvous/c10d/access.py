"""Who may reach a c10d host's etcd: the addresses it binds, the port's owner, its auth.

- **Addresses.** The narrowest set that serves the endpoint: what the endpoint's host
  resolves to here, plus ``--local-addr`` when given; a name that resolves only to
  loopback here (Debian maps a machine's own name to 127.0.1.1) while the other nodes
  reach it at a routable address gets this machine's non-loopback interface addresses,
  never ``0.0.0.0`` unless it has none.
- **The port's owner.** A would-be host that finds the port taken joins whoever holds it
  only if the listening socket (``/proc/net/tcp``, ``tcp6``: inode to uid) belongs to our
  effective uid: another user who binds the port first must not become the host.
- **Auth.** With ``cacert``/``cert``/``key`` the etcd child requires client certificates
  from its first request (``--client-cert-auth``); with ``user``/``password_file`` on top,
  etcd first serves only its private loopback URL, user auth is enabled there, and only
  then is it restarted on the public addresses: no request from elsewhere ever reaches it
  before auth is on.
"""

from __future__ import annotations

import base64
import ipaddress
import logging
import os
import secrets
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

import psutil

from supervisor.rendezvous.base import RendezvousError
from supervisor.rendezvous.etcd.wire.client import EtcdClient, TlsFiles, prefix_end

logger = logging.getLogger(__name__)

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's "st" column
KEY_ROOT = "/elastic-supervisor"  # both the rendezvous and the status summaries' keys
ROLE = "elastic-supervisor"


# ---------------------------------------------------------------------- addresses


def _is_loopback(ip: str) -> bool:
    return ipaddress.ip_address(ip.split("%", 1)[0]).is_loopback


def resolve(host: str) -> list[str]:
    """The IP addresses ``host`` resolves to here (IPv4 first), without duplicates."""
    try:
        return [str(ipaddress.ip_address(host))]
    except ValueError:
        pass
    try:
        found = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return []
    ips = list(dict.fromkeys(str(sockaddr[0]) for *_, sockaddr in found))
    return sorted(ips, key=lambda ip: ":" in ip)


def interface_addresses() -> list[str]:
    """This machine's non-loopback IP addresses (IPv6 link-local ones need a scope: out)."""
    ips = []
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            ip = ipaddress.ip_address(address.address.split("%", 1)[0])
            if not (ip.is_loopback or ip.is_link_local):
                ips.append(str(ip))
    return list(dict.fromkeys(ips))


@dataclass(frozen=True)
class ListenPlan:
    """The addresses the hosted etcd binds, and why (for the start-up log)."""

    ips: tuple[str, ...]
    why: str

    @property
    def loopback_only(self) -> bool:
        return all(ip != "0.0.0.0" and _is_loopback(ip) for ip in self.ips)


def listen_plan(host: str, local_addr: str | None) -> ListenPlan:
    """The narrowest addresses that serve ``host`` (see the module docstring)."""
    found = resolve(host)
    if not found:
        raise RendezvousError(f"c10d: cannot resolve {host!r}")
    if local_addr:
        extra = resolve(local_addr)
        if not extra:
            raise RendezvousError(f"c10d: cannot resolve --local-addr {local_addr!r}")
        return ListenPlan(tuple(dict.fromkeys([*found, *extra])),
                          f"{host} and --local-addr {local_addr}")
    if found == [host]:
        return ListenPlan((host,), "the endpoint's address")
    if host == "localhost" or not all(_is_loopback(ip) for ip in found):
        return ListenPlan(tuple(found), f"what {host} resolves to")
    # this machine's own name, mapped to loopback here; the other nodes resolve it to a
    # routable address of this machine: serve those, and the loopback one for ourselves
    public = interface_addresses()
    if not public:
        return ListenPlan(("0.0.0.0",), f"{host} resolves to loopback only here and this "
                                        "machine has no other address: every interface")
    return ListenPlan(tuple(dict.fromkeys([*found, *public])),
                      f"{host} resolves to loopback here: this machine's addresses")


# ---------------------------------------------------------------------- the port's owner


def port_owners(port: int, proc_net: Path = Path("/proc/net")) -> set[int]:
    """The uids of the sockets listening on TCP ``port`` in this network namespace."""
    owners: set[int] = set()
    for name in ("tcp", "tcp6"):
        try:
            lines = (proc_net / name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 8 or fields[3] != _LISTEN:
                continue
            try:
                if int(fields[1].rsplit(":", 1)[1], 16) == port:
                    owners.add(int(fields[7]))
            except ValueError:
                continue
    return owners


def check_port_owner(endpoint: str, port: int, *, proc_net: Path = Path("/proc/net")) -> None:
    """Raise ``RendezvousError`` unless the socket listening on ``port`` is our uid's."""
    owners = port_owners(port, proc_net)
    euid = os.geteuid()
    if owners == {euid}:
        return
    held = ("nothing listens there" if not owners
            else f"it is held by uid {', '.join(map(str, sorted(owners)))}")
    raise RendezvousError(
        f"c10d: {endpoint} is taken on this machine but {held}, not by this supervisor's uid "
        f"{euid}: refusing to join it as the host (another user could pose as the "
        f"rendezvous); free the port or set is_host=0 on this node")


# ---------------------------------------------------------------------- auth


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


class LoopbackTls(TlsFiles):
    """TLS to our own etcd child on its private loopback URL: the CA is checked, the
    host name is not (the certificate names the endpoint, not 127.0.0.1)."""

    def ssl_context(self) -> ssl.SSLContext:
        context = super().ssl_context()
        context.check_hostname = False
        return context


async def enable_auth(client: EtcdClient, user: str, password: str) -> None:
    """Turn etcd's user auth on (``client``: the private URL, no user yet): a root user
    with a random password, ``user`` with read/write on the job's keys, then
    ``auth enable``. Root's password is random and forgotten: nothing here needs root
    again, and a job's etcd lives only as long as the job."""
    root_password = secrets.token_urlsafe(24)
    key, end = _b64(KEY_ROOT), _b64(prefix_end(KEY_ROOT))
    for path, body in (
        ("/v3/auth/user/add", {"name": "root", "password": root_password}),
        ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
        ("/v3/auth/role/add", {"name": ROLE}),
        ("/v3/auth/role/grant", {"name": ROLE, "perm": {
            "permType": "READWRITE", "key": key, "range_end": end}}),
        ("/v3/auth/user/add", {"name": user, "password": password}),
        ("/v3/auth/user/grant", {"user": user, "role": ROLE}),
        ("/v3/auth/enable", {}),
    ):
        await client.call(path, body)
