"""Who may send or receive a buddy copy: the job's members, proven at every connection.

Two ways, chosen by the job's settings (both ends alike):

- **Mutual TLS** with the job's TLS material (``--rdzv-conf cacert=,cert=,key=``): each
  supervisor presents its certificate and accepts only a peer whose certificate the job's
  CA signed. Peers are reached by address, so the certificate's name is not checked: the
  CA's signature is the membership. The connection is encrypted.
- **A per-job secret**, when there is no TLS material: an HMAC-SHA256 challenge-response
  both ways (each side proves it knows the secret over the other's fresh nonce, so neither
  a replay nor a reflection passes), and a session key from both nonces that signs every
  frame. The state itself then crosses the network unencrypted and unsigned (its
  checksums are in the signed frames).

A peer that cannot prove it belongs gets nothing: the server sends no byte of state to
it, and the sender sends none to a buddy that cannot prove itself. ``AuthRefused``.
"""

from __future__ import annotations

import hmac
import secrets
import socket
import ssl
from collections.abc import Mapping
from dataclasses import dataclass

from supervisor.snapshots.replicate.wire import MAC_SIZE, AuthRefused, mac, recv_exact

HELLO = b"elastic-supervisor buddy 1\n"
NONCE = 32


@dataclass(frozen=True)
class PeerTls:
    """The job's PEM files: the CA that signs members, this node's certificate and key."""

    cacert: str
    cert: str
    key: str


def peer_tls(conf: Mapping[str, object]) -> PeerTls | None:
    """The job's TLS material from ``--rdzv-conf``'s parsed keys, when it allows mutual
    TLS (a CA and a certificate with its key); None otherwise (a CA alone, as for etcd
    with a password, cannot prove this node to its peers: the job's secret is used)."""
    files = [conf.get(name) for name in ("cacert", "cert", "key")]
    if not all(isinstance(f, str) and f for f in files):
        return None
    cacert, cert, key = (str(f) for f in files)
    return PeerTls(cacert, cert, key)


class Auth:
    """How this node proves itself and checks its peers. Build once (files read now)."""

    def __init__(self, *, tls: PeerTls | None = None, secret: bytes | None = None) -> None:
        if tls is None and not secret:
            raise ValueError("buddy copies need the job's TLS material or a job secret")
        self.tls = tls
        self.secret = secret
        self._server: ssl.SSLContext | None = None
        self._client: ssl.SSLContext | None = None
        if tls is not None:
            self._server = _context(ssl.PROTOCOL_TLS_SERVER, tls)
            self._client = _context(ssl.PROTOCOL_TLS_CLIENT, tls)

    @property
    def encrypted(self) -> bool:
        return self.tls is not None

    def accept(self, sock: socket.socket) -> tuple[socket.socket, bytes | None]:
        """Server side: the connection to use and its session key (None under TLS)."""
        if self._server is not None:
            try:
                return self._server.wrap_socket(sock, server_side=True), None
            except (ssl.SSLError, ssl.CertificateError) as exc:
                raise AuthRefused(f"TLS: {exc.__class__.__name__}: {exc}") from None
        assert self.secret is not None
        ours = secrets.token_bytes(NONCE)
        sock.sendall(HELLO + ours)
        answer = recv_exact(sock, NONCE + MAC_SIZE)
        theirs, proof = answer[:NONCE], answer[NONCE:]
        if not hmac.compare_digest(proof, mac(self.secret, b"client" + ours + theirs)):
            raise AuthRefused("the peer does not know the job's secret")
        sock.sendall(mac(self.secret, b"server" + ours + theirs))
        return sock, mac(self.secret, b"session" + ours + theirs)

    def connect(self, sock: socket.socket) -> tuple[socket.socket, bytes | None]:
        """Client side: the connection to use and its session key (None under TLS)."""
        if self._client is not None:
            try:
                return self._client.wrap_socket(sock), None
            except (ssl.SSLError, ssl.CertificateError) as exc:
                raise AuthRefused(f"TLS: {exc.__class__.__name__}: {exc}") from None
        assert self.secret is not None
        hello = recv_exact(sock, len(HELLO) + NONCE)
        if not hello.startswith(HELLO):
            raise AuthRefused("the peer is not a buddy server")
        server_nonce, ours = hello[len(HELLO):], secrets.token_bytes(NONCE)
        sock.sendall(ours + mac(self.secret, b"client" + server_nonce + ours))
        proof = recv_exact(sock, MAC_SIZE)
        if not hmac.compare_digest(proof, mac(self.secret, b"server" + server_nonce + ours)):
            raise AuthRefused("the buddy does not know the job's secret")
        return sock, mac(self.secret, b"session" + server_nonce + ours)


def _context(protocol: int, tls: PeerTls) -> ssl.SSLContext:
    context = ssl.SSLContext(protocol)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_verify_locations(cafile=tls.cacert)
    context.load_cert_chain(tls.cert, tls.key)
    context.verify_mode = ssl.CERT_REQUIRED  # the server too: mutual TLS
    if protocol == ssl.PROTOCOL_TLS_CLIENT:
        context.check_hostname = False  # peers are reached by address: the CA decides
    return context
