"""Training-state snapshots, the supervisor's side: shared memory per rank, the
completion channel, the restore step and persistence to ``--snapshot-dir``.

Nothing under this package imports torch: the worker side (``supervisor.snapshot``) turns
tensors into bytes and back; here bytes are kept, checked, chosen and written out.
``zipformat`` is shared by both sides and uses the standard library only.
"""
