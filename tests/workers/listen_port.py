"""Listen on 127.0.0.1:PORT (argv[1]), print ``listening``, hold the port until stdin closes.

Run as another user (``setpriv --reuid nobody``) to take a c10d endpoint's port first."""

from __future__ import annotations

import os
import socket
import sys

sock = socket.socket()
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sock.bind(("127.0.0.1", int(sys.argv[1])))
sock.listen()
os.write(1, b"listening\n")
sys.stdin.read()
