"""Training-state snapshots, the worker's side: ``save`` a rank's state into memory the
supervisor owns, ``load`` the step the whole job restores after a restart.

    from supervisor import snapshot

    restored = snapshot.load()            # None on the first attempt
    start = 0 if restored is None else restored[0] + 1
    if restored is not None:
        model.load_state_dict(restored[1]["model"])
        optimizer.load_state_dict(restored[1]["optim"])
    for step in range(start, steps):
        train_one_step()
        snapshot.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, step)

A snapshot is the bytes of a ``torch.save`` file (``supervisor.snapshots.zipformat``):
tensors are copied by torch's own ``copy_`` into shared memory the supervisor created for
this rank, the structure is pickled. ``load`` reads it back with ``torch.load(...,
weights_only=True)`` (torch's restricted unpickler); a state without tensors is read by a
stricter one of ours (``PLAIN_TYPES``). Light to import: no dependency of the supervisor,
and torch only once a tensor is seen (a state holds tensors only if torch is imported).

One thread per process calls ``save`` and ``load``. Outside a supervisor (plain
``python train.py``, torchrun) ``save`` returns False and ``load`` None, with one warning
each the first time: a script using them runs anywhere. ``docs/snapshots.md`` has the rest.
"""

from __future__ import annotations

from typing import Any

from supervisor.snapshots.worker import ENV_VAR, PLAIN_TYPES, SnapshotError, load, save

__all__ = ["ENV_VAR", "PLAIN_TYPES", "SnapshotError", "load", "save"]  # and Writer, Reader


def __getattr__(name: str) -> Any:
    """``Writer`` and ``Reader``: DCP's ``StorageWriter`` and ``StorageReader``, built on
    first use so that importing this module never imports torch.distributed.checkpoint.

    ``Writer(step: int, *, replicated: bool = False)``: ``dcp.save(state_dict,
    storage_writer=snapshot.Writer(step=N))`` keeps this rank's shards of step N in memory,
    with the same step rule as ``save``. ``Reader()``: ``dcp.load(state_dict,
    storage_reader=snapshot.Reader())`` restores the job's step; ``reader.step`` says which
    (None: nothing to restore, and ``dcp.load`` raises).
    """
    if name in ("Writer", "Reader"):
        from supervisor import snapshot_dcp

        return getattr(snapshot_dcp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
