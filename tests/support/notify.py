"""A service manager's notification socket (sd_notify), played by the test."""

from __future__ import annotations

import socket
import struct
from pathlib import Path

import anyio


def notify_socket(path: Path) -> socket.socket:
    """A datagram socket at ``path`` that learns each sender's pid, like systemd's."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    sock.bind(str(path))
    return sock


async def receive_notification(sock: socket.socket) -> tuple[int, str]:
    """One datagram and the sender's pid (SCM_CREDENTIALS)."""
    while True:
        await anyio.wait_readable(sock)
        try:
            data, ancdata, _flags, _addr = sock.recvmsg(4096, socket.CMSG_SPACE(12))
        except BlockingIOError:
            continue
        pid = 0
        for level, kind, cdata in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid = struct.unpack("iII", cdata[:12])[0]
        return pid, data.decode()
