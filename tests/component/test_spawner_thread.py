"""Every child is forked from one long-lived spawner thread (``spawn.Spawner``).

The kernel sends a child its parent-death signal when the *thread* that forked it exits.
Regression (issue 25, finding 7): standbys forked from anyio worker threads were SIGKILLed
once anyio retired the idle thread. The test retires the thread a spawn was asked from and
checks that the child lives; a control child forked by that thread itself dies, which
shows the thread really exited (and that the test can fail).
"""

from __future__ import annotations

import os
import select
import shutil
import threading

import anyio
import pytest

from supervisor.workers.spawn import DeathSignal, Spawner, Worker, WorkerSpec, spawn_worker
from tests.support.processes import pid_alive


def _cat(death: DeathSignal) -> tuple[Worker, int, int]:
    """A ``cat`` child: (worker, our end of its stdin, our end of its stdout)."""
    cat = shutil.which("cat")
    assert cat is not None
    in_r, in_w = os.pipe2(os.O_CLOEXEC)
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    spec = WorkerSpec(0, 0, [cat], dict(os.environ), stdout=out_w)
    try:
        worker = spawn_worker(spec, death, stdin=in_r)
    finally:
        os.close(in_r)
        os.close(out_w)
    return worker, in_w, out_r


async def test_a_child_outlives_the_thread_that_asked_for_it() -> None:
    spawner = Spawner("test-spawner")
    death = DeathSignal()
    made: dict[str, tuple[Worker, int, int]] = {}

    def short_lived() -> None:
        made["control"] = _cat(death)  # forked by this thread: dies with it
        made["spawned"] = spawner.call(_cat, death)  # forked by the spawner thread
        # the death signal is set in the child after the fork (setpriv, then exec cat): a
        # thread that exits before that delivers nothing, so exit once cat echoes a line
        _, stdin, stdout = made["control"]
        os.write(stdin, b"up\n")
        ready, _, _ = select.select([stdout], [], [], 10)
        assert ready and os.read(stdout, 64) == b"up\n"

    thread = threading.Thread(target=short_lived)
    thread.start()
    thread.join()
    control, spawned = made["control"][0], made["spawned"][0]
    try:
        with anyio.fail_after(10):  # the thread's exit delivers the control's SIGKILL
            await anyio.wait_readable(control.pidfd)
        assert control.poll_exit() is not None and control.poll_exit().signal == 9
        _, stdin, stdout = made["spawned"]
        os.write(stdin, b"alive\n")
        with anyio.fail_after(10):
            await anyio.wait_readable(stdout)
        assert os.read(stdout, 64) == b"alive\n"
        assert pid_alive(spawned.pid)
    finally:
        for worker, stdin, stdout in made.values():
            os.close(stdin)
            os.close(stdout)
            worker.signal_group(9)
            worker.reap()
        spawner.stop()


async def test_spawn_runs_on_the_spawner_thread_without_blocking_the_loop() -> None:
    spawner = Spawner("test-spawner")
    try:
        tid = await spawner.spawn(threading.get_native_id)
        assert tid == spawner.native_id and tid != threading.get_native_id()
        with pytest.raises(ZeroDivisionError):
            await spawner.spawn(lambda: 1 // 0)
        assert spawner.call(threading.get_native_id) == tid  # one thread, still alive
    finally:
        spawner.stop()
    assert spawner.native_id is None
