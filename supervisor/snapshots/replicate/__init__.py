"""Buddy copies, the transfer layer: a node's newest complete step sent to its buddy's
supervisor over TCP, and kept there in shared memory.

- ``wire``: framing, the messages, the counters, the errors.
- ``auth``: who may speak: mutual TLS with the job's certificates, or a per-job secret
  (an HMAC challenge-response both ways).
- ``stream``: bytes between a region and a connection, both ways, and their check.
- ``send``: the sending side (one blocking transfer in a thread, and the task that sends
  each newer step to the current buddy).
- ``receive``: the buddy's server: it authenticates, admits (``core.buddies.admit``),
  receives into regions of its own, checks every byte against the save's checksums and
  only then replaces the copy it kept; it also serves a kept copy back to a member.
- ``fetch``: a member (the node that now runs a lost node's ranks) fetching them back.
- ``copies``: one node's side put together (server, sender, counters) and what a new
  round changes: the seam for the rendezvous integration.

Which node is whose buddy comes from the round (``core.buddies.plan``); wiring it to the
rendezvous, and fetching a lost node's copy before its ranks load (the call is here; using
it at a restart is not), are not built yet.
Bulk bytes never cross the event loop: they move in worker threads on blocking sockets,
from and into the regions' pages (``sendfile``, ``recv_into`` a mapping).
"""
