"""A tiny job: every rank says hello with its place in the group, then exits 0."""

import os
import socket

print(
    f"hello from rank {os.environ['RANK']}/{os.environ['WORLD_SIZE']} "
    f"(local rank {os.environ['LOCAL_RANK']}) on {socket.gethostname()}, "
    f"master {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}, "
    f"restart {os.environ['TORCHELASTIC_RESTART_COUNT']}",
    flush=True,
)
