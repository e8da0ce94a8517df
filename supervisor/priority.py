"""The event loop's CPU priority: ahead of the workers it starts, and of nothing else.

A restart starts a whole group of interpreters at once. Each worker runs in a session of
its own (``setsid``), and with the kernel's autogroups (``kernel.sched_autogroup_enabled``,
the default of most distributions) each session is a scheduling group of its own weight:
on a busy node the supervisor then gets one share of the CPU against eight or more, and
``/healthz`` waits behind the interpreters it just started (issue 29: on a node of one
CPU the event loop spent 55 ms of a restart's 130 waiting for the CPU, and the p99 went
from 2 to 12 ms). So the daemon gives its event loop a higher priority, where it may:

- the event loop's thread gets nice ``loop_nice`` with ``SCHED_RESET_ON_FORK``, so every
  thread and process it creates later starts at nice 0 again; the workers are forked
  from the spawner thread, created before, at nice 0. This is what counts where the
  supervisor and its workers share a cgroup with the CPU controller (tasks compete one by
  one there).
- its autogroup gets the same nice value (``/proc/self/autogroup``), only when the
  supervisor leads its own session (a systemd service does): started from a shell, the
  autogroup is the terminal's, and its other processes are not ours to raise. A worker's
  session (``setsid``) gets a new autogroup at nice 0.

Either needs ``CAP_SYS_NICE`` (root) or an ``RLIMIT_NICE`` that allows it (systemd's
``LimitNICE=``); without, nothing changes. A supervisor started at a nice value other
than 0 (``nice``, systemd's ``Nice=``) keeps it and its workers keep theirs: that is the
caller's choice. Only the daemon does this; the embedded Python API never changes the
priority of the process it runs in.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

logger = logging.getLogger(__name__)

AUTOGROUP = "/proc/self/autogroup"


@dataclass(frozen=True, slots=True)
class LoopPriority:
    """What was set: the loop thread's nice value, and the autogroup's (None: untouched)."""

    thread_nice: int
    autogroup_nice: int | None
    reason: str = ""  # why nothing was set, for the log


def raise_loop_priority(nice: int) -> LoopPriority:
    """Give the calling thread (the event loop's) nice ``nice`` (< 0) and
    our autogroup the same; see the module docstring. Never raises."""
    tid = threading.get_native_id()
    current = os.getpriority(os.PRIO_PROCESS, tid)
    if nice >= 0:
        return LoopPriority(current, None, "loop_nice is 0")
    if current != 0 or os.sched_getscheduler(0) != os.SCHED_OTHER:
        return LoopPriority(current, None, "started at a priority of its own, kept")
    try:
        # a nice value is a thread's on Linux: PRIO_PROCESS with a thread id sets only it
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError as exc:
        return LoopPriority(current, None, f"cannot raise it ({exc.strerror}: needs "
                                           "CAP_SYS_NICE or LimitNICE=)")
    try:
        # what this thread creates from now on starts at nice 0 again
        os.sched_setscheduler(0, os.SCHED_OTHER | os.SCHED_RESET_ON_FORK, os.sched_param(0))
    except OSError as exc:  # not seen on Linux >= 2.6.32; never leave a raised nice to inherit
        os.setpriority(os.PRIO_PROCESS, tid, current)
        return LoopPriority(current, None, f"cannot reset it on fork ({exc.strerror})")
    return LoopPriority(nice, _raise_autogroup(nice))


def _raise_autogroup(nice: int) -> int | None:
    """Set our autogroup's nice value if we lead our session and it is still 0."""
    if os.getsid(0) != os.getpid():
        return None
    try:
        with open(AUTOGROUP, encoding="ascii") as f:  # "/autogroup-123 nice 0"
            if int(f.read().split()[-1]) != 0:
                return None
        with open(AUTOGROUP, "w", encoding="ascii") as f:
            f.write(str(nice))
    except (OSError, ValueError, IndexError):  # no autogroups in this kernel; not allowed
        return None
    return nice


def describe(priority: LoopPriority) -> str:
    if priority.reason:
        return f"event loop at nice {priority.thread_nice}: {priority.reason}"
    group = ("" if priority.autogroup_nice is None
             else f" (its autogroup too, nice {priority.autogroup_nice})")
    return f"event loop at nice {priority.thread_nice}{group}; workers start at nice 0"

