"""The lab's delayer: hold every packet of one nfnetlink queue for a fixed time, then pass it.

This kernel has no ``sch_netem``, and nft's ``queue`` statement is not built in
(``CONFIG_NFT_QUEUE``), but iptables' ``NFQUEUE`` target is. ``NetLab.delay`` makes the
switch namespace's iptables (legacy) send the frames the bridge forwards from one host to
another (br_netfilter) to queue ``--queue``, and starts this program in that namespace
(nfnetlink queues are per network namespace) to read them. It asks for metadata only (no
payload is copied), stamps each packet when it arrives, and gives it the ACCEPT verdict
``--delay-ms`` later; the delay is the same for every packet of the queue and the verdicts
go in arrival order, so the queue stays in order.

Run as a script by the lab (``sys.executable netdelay.py``), needs ``fnfqueue`` (``pip
install fnfqueue``). Its protocol with the lab: it prints ``ready`` once bound to its queue
(before that, the lab adds no rule: a queue without a reader drops its packets). Its stdin
is the lab's pipe: end of file (the lab closed it, or the lab's process died, also by
SIGKILL) means stop: it reads no more, passes what it holds when each packet is due, prints
``released N`` and exits. The lab removes its rules first, so nothing new is queued then.
"""

from __future__ import annotations

import argparse
import collections
import sys
import threading
import time
from typing import Any

import fnfqueue  # type: ignore[import-untyped]

META_SIZE = 4096  # one queued packet's message without payload: headers and metadata
MAX_HELD = 10_000  # packets held in the kernel at once; beyond, the kernel drops (tail drop)


class Holder:
    """Packets waiting for their verdict, oldest first (one fixed delay: FIFO is in
    order of due time)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.released = 0
        self._held: collections.deque[tuple[float, Any]] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False

    def hold(self, packet: Any) -> None:
        with self._cond:
            self._held.append((time.monotonic() + self.delay, packet))
            self._cond.notify()

    def close(self) -> None:
        """No more packets come: ``release_due`` returns once it has passed the rest."""
        with self._cond:
            self._closed = True
            self._cond.notify()

    def release_due(self) -> None:
        """Accept each packet when it is due, until closed and empty."""
        while True:
            with self._cond:
                while not self._held and not self._closed:
                    self._cond.wait()
                if not self._held:
                    return
                due, packet = self._held[0]
                wait = due - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)  # a new packet is due later: no need to wake
                    continue
                self._held.popleft()
            packet.accept()  # the verdict; outside the lock: the reader keeps holding
            self.released += 1


def read_queue(conn: Any, holder: Holder) -> None:
    """Hand every queued packet to ``holder`` until the connection is closed."""
    while True:
        try:
            for packet in conn:
                holder.hold(packet)
            return
        except fnfqueue.BufferOverflowException:
            # the socket's buffer overflowed: the kernel dropped those packets, as a full
            # router queue would; go on
            conn.reset()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--queue", type=int, required=True, help="nfnetlink queue number")
    p.add_argument("--delay-ms", type=float, required=True, help="how long each packet waits")
    args = p.parse_args()
    holder = Holder(args.delay_ms / 1000)
    conn = fnfqueue.Connection(packet_size=META_SIZE)
    queue = conn.bind(args.queue)
    queue.set_mode(fnfqueue.MAX_PAYLOAD, fnfqueue.COPY_META)
    queue.set_maxlen(MAX_HELD)
    queue.gso = True  # metadata only: a GSO packet needs no splitting to be held
    reader = threading.Thread(target=read_queue, args=(conn, holder), daemon=True)
    releaser = threading.Thread(target=holder.release_due)
    reader.start()
    releaser.start()
    print("ready", flush=True)
    sys.stdin.buffer.read()  # until the lab closes its end, or dies
    holder.close()
    releaser.join()
    conn.close()  # after the last verdict: closing unbinds, and the kernel drops the held
    print(f"released {holder.released}", flush=True)


if __name__ == "__main__":
    main()
