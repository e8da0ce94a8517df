"""Training-state snapshots, the supervisor's side: shared memory per rank, the
completion channel, the restore step and persistence to ``--snapshot-dir``.

Nothing the supervisor runs here imports torch: the worker side (``supervisor.snapshot``,
built on ``worker``, which runs in the job's process) turns tensors into bytes and back;
the rest keeps, checks, chooses and writes out bytes. ``zipformat`` is shared by both
sides and uses the standard library only.
"""
