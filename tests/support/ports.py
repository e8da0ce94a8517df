"""Free loopback ports, for servers that must be told their port before they bind it."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port the kernel just gave out on 127.0.0.1; another process may take it before
    the caller binds it, so a server that fails with "address already in use" retries."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
