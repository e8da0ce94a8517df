"""A standby whose socket is reset when the supervisor shuts down ends quietly: no
traceback reaches the console (issues 26 and 27 saw ``ConnectionResetError`` there)."""

from __future__ import annotations

import select
import socket
import subprocess
import sys

from supervisor.workers.warm.standby import standby_code


def test_a_reset_socket_ends_the_standby_without_a_traceback() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with theirs:
        standby = subprocess.Popen([sys.executable, "-u", "-c", standby_code()], stdin=theirs,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        # it reports b"R" once started; left unread, closing our end resets its socket
        assert select.select([ours], [], [], 30)[0], "the standby never reported"
        ours.close()
        _, err = standby.communicate(timeout=30)
    finally:
        if standby.poll() is None:
            standby.kill()
            standby.wait()
    assert err == b""
    assert standby.returncode == 0
