"""Stands in for a rank-0 worker whose store binds MASTER_PORT late (as torch's does after
``import torch``): prints ``waiting PORT``, blocks on opening the FIFO argv[1] until the
test opens it, then binds the port as torch's TCPStore does (``SO_REUSEADDR``), listens
and prints ``listening PORT``."""

from __future__ import annotations

import os
import socket
import sys

port = int(os.environ["MASTER_PORT"])
print(f"waiting {port}", flush=True)
with open(sys.argv[1]):  # returns once the test opened the FIFO for writing
    pass
store = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
store.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
store.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
store.bind(("::", port))
store.listen()
print(f"listening {port}", flush=True)
store.close()
