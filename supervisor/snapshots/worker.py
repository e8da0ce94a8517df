"""The worker's side of training-state snapshots: what ``supervisor.snapshot`` (the public
module) and ``supervisor.snapshot_dcp`` (DCP's writer and reader) are built on. Runs in the
job's environment: standard library only, torch imported once a tensor is seen.
"""

from __future__ import annotations

import collections
import importlib
import io
import json
import mmap
import os
import pickle
import socket
import sys
import warnings
import zipfile
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from supervisor.snapshots import zipformat

ENV_VAR = "ELASTIC_SUPERVISOR_SNAPSHOT"
"""The path of this node's snapshot socket, set by the supervisor in every worker."""

REPLY_TIMEOUT = 60.0  # s: a supervisor that does not answer a save in this long is gone
PICKLE_PROTOCOL = 2  # torch.save's default
PLAIN_TYPES: frozenset[type] = frozenset({
    dict, list, tuple, set, frozenset, str, bytes, bytearray, int, float, complex, bool,
    type(None), collections.OrderedDict,
})
"""What ``load`` rebuilds from a snapshot without tensors (anything else is refused)."""

__all__ = ["ENV_VAR", "PLAIN_TYPES", "SnapshotError", "load", "save"]


class SnapshotError(Exception):
    """A state that cannot be snapshotted (a sparse tensor, a tensor subclass, DTensor)."""


def save(state: Any, step: int, *, replicated: bool = False) -> bool:
    """Keep a copy of ``state`` as this rank's snapshot of ``step``; True once it is kept.

    ``state`` is what ``torch.save`` takes: nested dicts, lists and tuples of tensors and
    picklable values. It returns once the copy is taken: the caller may change its tensors
    right after. Tensors on any device are copied to CPU memory; sparse tensors, tensor
    subclasses and DTensor raise ``SnapshotError`` (DTensor goes through ``Writer``).
    ``step`` must be above this rank's last saved (or restored) step. ``replicated=True``
    declares that every rank holds the same state (DDP): the node keeps one copy, which
    any rank, under any world size, restores.

    True: the copy is kept. Its checksum is computed, and the supervisor told the save is
    complete, in a thread beside the caller's next step (the next ``save`` or ``load``
    waits for it); a crash before that restores the step before. False, with one warning,
    when the snapshot cannot be kept: outside a supervisor, a step not above the last, no
    room in shared memory, a state above ``--snapshot-memory-limit``. The last complete
    snapshot stays; training goes on.
    """
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"snapshot step must be an int, got {type(step).__name__}")
    client = _client("save")
    if client is None:
        return False
    return client.save(state, step, replicated)


def load() -> tuple[int, Any] | None:
    """The step the whole job restores in this attempt, and this rank's state at it.

    The step is decided once per attempt: every call returns the same step, with tensors
    the caller owns, on the CPU, identical bit for bit to what was saved. None when the
    job holds no snapshot to restore (the first attempt), or outside a supervisor.
    """
    client = _client("load")
    if client is None:
        return None
    return client.load()


# ---------------------------------------------------------------- the process's client

_CLIENT: _Client | None = None
_WARNED: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def _client(what: str) -> _Client | None:
    global _CLIENT
    if _CLIENT is not None and _CLIENT.pid == os.getpid():
        return _CLIENT
    path = os.environ.get(ENV_VAR)
    if not path:
        nothing = "returns False" if what == "save" else "returns None"
        _warn_once(f"outside-{what}", f"supervisor.snapshot.{what}() {nothing}: not running "
                   f"under elastic-supervisor with snapshots ({ENV_VAR} is not set)")
        return None
    _CLIENT = _Client(path, int(os.environ.get("RANK", "0")))
    return _CLIENT


class _Refused(Exception):
    """The supervisor did not keep a save (the reason is its answer)."""


class _Client:
    """This process's connection to the supervisor and its mapped slots."""

    def __init__(self, path: str, rank: int) -> None:
        self.path = path
        self.rank = rank
        self.pid = os.getpid()  # a forked child connects anew
        self.sock: socket.socket | None = None
        self.reader: io.BufferedReader | None = None
        self.maps: dict[str, mmap.mmap] = {}  # slot path -> its mapping, kept across saves
        self.last_step: int | None = None
        # checksums and completions run here, one at a time, in the order of the saves
        self.background = ThreadPoolExecutor(1, thread_name_prefix="snapshot")
        self.pending: Future[None] | None = None

    # --------------------------------------------------------------- the wire
    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        """One request, one answer (JSON lines)."""
        if self.sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(REPLY_TIMEOUT)
            sock.connect(self.path)
            self.sock, self.reader = sock, sock.makefile("rb")
        assert self.reader is not None
        try:
            self.sock.sendall(json.dumps({"rank": self.rank, **request}).encode() + b"\n")
            line = self.reader.readline()
        except OSError:
            self.close_socket()
            raise
        if not line:
            self.close_socket()
            raise ConnectionError("the supervisor closed the snapshot socket")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def close_socket(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.sock = self.reader = None

    # --------------------------------------------------------------- save
    def save(self, state: Any, step: int, replicated: bool) -> bool:
        self.settle()
        if self.last_step is not None and step <= self.last_step:
            _warn_once("step", f"supervisor.snapshot.save(step={step}) refused: the step "
                       f"must be above this rank's last one ({self.last_step})")
            return False
        pickled, storages = _serialise(state)
        entries = [("data.pkl", len(pickled)), (".format_version", 1),
                   (".storage_alignment", 2), ("byteorder", len(sys.byteorder))]
        entries += [(f"data/{key}", storage.nbytes()) for key, storage in storages]
        entries.append(("version", 2))
        layout = zipformat.plan(entries)
        try:
            reply = self.ask({"op": "reserve", "step": step, "size": layout.size,
                              "replicated": replicated})
            if reply.get("held"):  # replicated: another rank of the node writes this step
                self.last_step = step
                return True
            if not reply.get("ok"):
                raise _Refused(str(reply.get("reason", "refused")))
            mapped = self._map(str(reply["path"]), int(reply["capacity"]))
            _copy(mapped, layout, pickled, storages)
        except _Refused as exc:
            _warn_refused(step, str(exc))
            return False
        except (OSError, ValueError) as exc:  # the supervisor is gone or answered nonsense
            _warn_once("failed", f"supervisor.snapshot.save(step={step}) failed: {exc}")
            return False
        self.last_step = step
        # the copy is taken: the CRC-32s and the completion run beside the next step
        self.pending = self.background.submit(self._complete, mapped, layout, step,
                                              int(reply["slot"]), replicated)
        return True

    def settle(self) -> None:
        """Wait until the last save is complete (or known not kept)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        try:
            pending.result()
        except _Refused as exc:
            _warn_refused(self.last_step, str(exc))
        except (OSError, ValueError) as exc:
            _warn_once("failed", f"supervisor.snapshot.save(step={self.last_step}) was not "
                       f"completed: {exc}")

    def _complete(self, mapped: mmap.mmap, layout: zipformat.Layout, step: int,
                  slot: int, replicated: bool) -> None:
        """Checksum what was copied, write the headers, tell the supervisor it is complete."""
        view = memoryview(mapped)
        try:
            crcs = [zlib.crc32(view[r.data:r.data + r.size]) for r in layout.records]
            checksum = zipformat.finish(view, layout, crcs)
        finally:
            view.release()
        reply = self.ask({"op": "commit", "step": step, "slot": slot, "size": layout.size,
                          "checksum": checksum, "replicated": replicated})
        if not reply.get("ok"):
            raise _Refused(str(reply.get("reason", "refused")))

    def _map(self, path: str, capacity: int) -> mmap.mmap:
        mapped = self.maps.get(path)
        if mapped is not None and len(mapped) >= capacity:
            return mapped
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            mapped = mmap.mmap(fd, capacity, mmap.MAP_SHARED,
                               mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._forget_slots(keep=path)
        self.maps[path] = mapped
        return mapped

    def _forget_slots(self, keep: str) -> None:
        """Unmap slots whose file is gone (the supervisor replaced a region that grew)."""
        for path in [p for p in self.maps if p != keep and not os.path.exists(p)]:
            self.maps.pop(path).close()

    # --------------------------------------------------------------- load
    def load(self) -> tuple[int, Any] | None:
        self.settle()
        try:
            reply = self.ask({"op": "restore"})
        except (OSError, ValueError) as exc:
            _warn_once("load-failed", f"supervisor.snapshot.load() failed: {exc}")
            return None
        if not reply.get("ok") or reply.get("step") is None:
            return None
        step, size = int(reply["step"]), int(reply["size"])
        fd = os.open(str(reply["path"]), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        # no explicit close: views of the mapping may live on in a traceback; the mapping
        # goes with the last reference (the supervisor keeps the region for the attempt)
        view = memoryview(mapped)
        if zipformat.directory_checksum(view, size) != reply.get("checksum"):
            _warn_once("checksum", f"supervisor.snapshot.load(): step {step} fails its "
                       "checksum; not restored")
            return None
        state = _deserialise(view, size)
        self.last_step = step if self.last_step is None else max(self.last_step, step)
        return step, state


def _warn_refused(step: int | None, reason: str) -> None:
    _warn_once(f"refused-{reason}", f"supervisor.snapshot.save(step={step}) not kept: {reason}")


def _copy(mapped: mmap.mmap, layout: zipformat.Layout, pickled: bytes,
          storages: list[tuple[str, Any]]) -> None:
    """Every record's data to its offset in the slot: tensors' storages with torch's own
    ``copy_`` (from any device), the small records as bytes."""
    small = [pickled, b"1", b"64", sys.byteorder.encode()]
    with memoryview(mapped) as view:
        for record, data in zip(layout.records[:len(small)], small, strict=True):
            view[record.data:record.data + record.size] = data
        version = layout.records[-1]
        view[version.data:version.data + 2] = b"3\n"
    if not storages:
        return
    import torch

    for record, (_, storage) in zip(layout.records[len(small):], storages, strict=False):
        if record.size == 0:
            continue
        source = torch.empty(0, dtype=torch.uint8, device=storage.device)
        source.set_(storage, 0, (record.size,), (1,))
        target = torch.frombuffer(mapped, dtype=torch.uint8, count=record.size,
                                  offset=record.data)
        target.copy_(source)
        del target  # the mapping may be closed later: hold no export of it


# ---------------------------------------------------------------- (de)serialising


def _serialise(state: Any) -> tuple[bytes, list[tuple[str, Any]]]:
    """``data.pkl`` as torch.save pickles it, and the storages it refers to by key."""
    out = io.BytesIO()
    pickler = _Pickler(out, protocol=PICKLE_PROTOCOL)
    pickler.dump(state)
    return out.getvalue(), list(pickler.storages.items())


class _Pickler(pickle.Pickler):
    """torch.save's pickling: a storage becomes a persistent reference (its bytes go to
    their own record), stored as located on the CPU (where the copy lives)."""

    def __init__(self, file: io.BytesIO, protocol: int) -> None:
        super().__init__(file, protocol=protocol)
        self.torch = sys.modules.get("torch")  # a state holds tensors only if imported
        self.storages: dict[str, Any] = {}
        self.keys: dict[int, str] = {}

    def reducer_override(self, obj: Any) -> Any:
        torch = self.torch
        if torch is not None and isinstance(obj, torch.Tensor):
            _check_tensor(torch, obj)
        return NotImplemented

    def persistent_id(self, obj: Any) -> Any:
        torch = self.torch
        if torch is None or not isinstance(obj, torch.storage.TypedStorage):
            return None
        storage = obj._untyped_storage
        key = self.keys.setdefault(storage._cdata, str(len(self.keys)))
        self.storages[key] = storage
        storage_type = getattr(torch, obj._pickle_storage_type())
        return ("storage", storage_type, key, "cpu", obj._size())


def _check_tensor(torch: Any, tensor: Any) -> None:
    kind = type(tensor)
    if kind.__name__ == "DTensor":
        raise SnapshotError("DTensor cannot be saved with snapshot.save: use "
                            "dcp.save(state, storage_writer=snapshot.Writer(step=N))")
    if kind not in (torch.Tensor, torch.nn.Parameter):
        raise SnapshotError(f"tensor subclass {kind.__qualname__} cannot be snapshotted: "
                            "save plain tensors (e.g. its state_dict)")
    if tensor.layout != torch.strided:
        raise SnapshotError(f"{tensor.layout} tensors cannot be snapshotted: save a dense "
                            "tensor (.to_dense()) or its indices and values")


def _deserialise(view: memoryview, size: int) -> Any:
    archive = zipfile.ZipFile(_ReadOnly(view, size))
    names = archive.namelist()
    if any(name.split("/", 1)[-1].startswith("data/") for name in names):
        import torch  # the snapshot holds tensors: torch's own reader and rules

        return torch.load(io.BufferedReader(_ReadOnly(view, size)), weights_only=True,
                          map_location="cpu")
    pickled = archive.read(f"{zipformat.ARCHIVE}/data.pkl")
    return _PlainUnpickler(io.BytesIO(pickled)).load()


class _PlainUnpickler(pickle.Unpickler):
    """Rebuilds only ``PLAIN_TYPES``: a state without tensors cannot run code on load."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = {f"{t.__module__}.{t.__qualname__}" for t in PLAIN_TYPES}
        allowed.add("_codecs.encode")  # how protocol 2 pickles bytes (torch allows it too)
        if module == "__builtin__":
            module = "builtins"
        if f"{module}.{name}" in allowed:
            return getattr(importlib.import_module(module), name)
        raise pickle.UnpicklingError(f"snapshot.load refuses {module}.{name}: a state "
                                     "without tensors holds only plain values")


class _ReadOnly(io.RawIOBase):
    """The first ``size`` bytes of a mapped slot as a seekable file (no copy until read)."""

    def __init__(self, view: memoryview, size: int) -> None:
        self.view = view[:size]
        self.position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        count = min(len(buffer), len(self.view) - self.position)
        buffer[:count] = self.view[self.position:self.position + count]
        self.position += count
        return count

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: len(self.view)}
        self.position = max(0, base[whence] + offset)
        return self.position

    def tell(self) -> int:
        return self.position

