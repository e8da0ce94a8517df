"""DCP's storage writer and reader over ``supervisor.snapshot``: ``dcp.save`` and
``dcp.load`` of a sharded state (FSDP2's DTensor state dicts) kept in the supervisor's
memory, with the same step rule as ``snapshot.save``.

    dcp.save(state_dict, storage_writer=snapshot.Writer(step=n))
    reader = snapshot.Reader()
    if reader.step is not None:
        dcp.load(state_dict, storage_reader=reader)

Each rank keeps the items DCP plans for it (its local shards, as plain tensors, and the
bytes items) as its snapshot of the step; the coordinator (rank 0) keeps DCP's metadata
with them. On load every rank reads back its own items and rank 0's metadata is
broadcast (a collective: every rank calls ``dcp.load``). A restore needs the sharding of
the save (the same world size and plan): an item another rank held is refused with an
error. Imported by ``supervisor.snapshot`` on first use of ``Writer`` or ``Reader``.
"""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from supervisor.snapshots import worker as snapshot

# what rank 0's snapshot holds besides tensors: DCP's own metadata classes (and enums),
# allowed to torch.load's weights_only unpickler for the restore only
_METADATA_TYPES: list[Any] = [
    value for value in vars(dcp_metadata).values()
    if isinstance(value, type) and value.__module__ == dcp_metadata.__name__]


class Writer(StorageWriter):
    """Keeps this rank's part of a ``dcp.save`` as its snapshot of ``step``."""

    def __init__(self, step: int, *, replicated: bool = False) -> None:
        super().__init__()
        self.step = step
        self.replicated = replicated
        self.coordinator = False
        self.rank = 0
        self.items: dict[str, Any] = {}
        self.kept: bool | None = None  # what ``snapshot.save`` returned

    def reset(self, checkpoint_id: Any = None) -> None:
        self.items = {}

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.coordinator = is_coordinator
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results: list[WriteResult] = []
        for number, item in enumerate(plan.items):
            key = f"{self.rank}/{number}"
            data = planner.resolve_data(item)
            if item.type is WriteItemType.BYTE_IO:
                assert isinstance(data, io.BytesIO)
                value: Any = data.getvalue()
                size = len(value)
            else:
                value = data.detach() if isinstance(data, torch.Tensor) else data
                size = value.numel() * value.element_size()
            self.items[key] = value
            results.append(WriteResult(index=item.index, size_in_bytes=size,
                                       storage_data={"rank": self.rank, "key": key}))
        if not self.coordinator:  # the coordinator keeps its items with the metadata
            self.kept = snapshot.save({"dcp_items": self.items}, self.step,
                                      replicated=self.replicated)
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {r.index: r.storage_data for rs in results for r in rs}
        self.kept = snapshot.save({"dcp_items": self.items, "dcp_metadata": metadata},
                                  self.step, replicated=self.replicated)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True

    def storage_meta(self) -> dcp_metadata.StorageMeta | None:
        return None


class Reader(StorageReader):
    """Restores the job's step (``step``; None: nothing to restore) through ``dcp.load``."""

    def __init__(self) -> None:
        super().__init__()
        with torch.serialization.safe_globals(_METADATA_TYPES):
            restored = snapshot.load()
        self.step: int | None = None if restored is None else restored[0]
        self.state: dict[str, Any] = {} if restored is None else restored[1]
        self.metadata: Metadata | None = None

    def reset(self, checkpoint_id: Any = None) -> None:
        return None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.step is None:
            raise RuntimeError("snapshot.Reader: the job holds no snapshot to restore")
        if self.metadata is None:
            found = [self.state.get("dcp_metadata")]
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                dist.broadcast_object_list(found, src=0)  # only rank 0 kept it
            if not isinstance(found[0], Metadata):
                raise RuntimeError("snapshot.Reader: the snapshot holds no DCP metadata")
            self.metadata = found[0]
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        self.metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        assert self.metadata is not None
        wanted = [self.metadata.storage_data[r.storage_index]["key"] for r in plan.items]
        items = self._with_peers(wanted)
        for request in plan.items:
            where = self.metadata.storage_data[request.storage_index]
            if where["key"] not in items:
                raise RuntimeError(
                    f"snapshot.Reader: {request.storage_index.fqn} was kept by rank "
                    f"{where['rank']}, which holds no snapshot of it now")
            value = items[where["key"]]
            if isinstance(value, bytes):
                planner.load_bytes(request, io.BytesIO(value))
                continue
            tensor = narrow_tensor_by_index(value, request.storage_offsets, request.lengths)
            target = planner.resolve_tensor(request).detach()
            target.copy_(tensor)
            planner.commit_tensor(request, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True

    def _with_peers(self, wanted: list[str]) -> dict[str, Any]:
        """This rank's items, plus those it needs that a peer kept: DCP saves a tensor
        every rank holds (a replicated one) on one rank only, and loads it on every rank.
        Two collectives (every rank calls ``read_data`` once, in step): who needs what,
        then who gives what (such items are small: the sharded ones stay local)."""
        items: dict[str, Any] = dict(self.state.get("dcp_items", {}))
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return items
        missing = [key for key in wanted if key not in items]
        needs: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(needs, missing)
        asked = {key for need in needs for key in need}
        given: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(given, {k: v for k, v in items.items() if k in asked})
        for part in given:
            for key, value in part.items():
                items.setdefault(key, value)
        return items
