"""``Worker.reap`` from two threads at once reaps once and closes the pidfd once.

A fork server found dead at the same moment by a fork on the spawner thread and by the
event loop was stopped twice: both passed the "not reaped yet" check, and the second
close of its pidfd raised EBADF in the loop (or could have closed an fd reused meanwhile).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading

from supervisor.workers.spawn import DeathSignal, WorkerSpec, on_reaping, spawn_worker


def test_two_threads_reaping_one_worker_reap_it_once() -> None:
    true = shutil.which("true")
    assert true is not None
    worker = spawn_worker(WorkerSpec(0, 0, [true], dict(os.environ)), DeathSignal())
    # the reaping hook holds a reaper until the other one is in the hook too (or 1 s has
    # passed): without a lock both get past "not reaped yet", as in the race
    both = threading.Barrier(2, timeout=1)
    reapers: list[int] = []
    errors: list[BaseException] = []

    def hold(pid: int) -> None:
        reapers.append(pid)
        with contextlib.suppress(threading.BrokenBarrierError):
            both.wait()  # broken after 1 s alone in here: the other reaper waits for the lock

    def reap() -> None:
        try:
            worker.reap()
        except BaseException as exc:  # what the test looks for
            errors.append(exc)

    remove = on_reaping(hold)
    try:
        threads = [threading.Thread(target=reap) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        remove()
    assert errors == [] and reapers == [worker.pid] and worker.reaped
