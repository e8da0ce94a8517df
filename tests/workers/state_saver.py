"""A worker that keeps a state with ``supervisor.snapshot`` (no torch unless --tensors).

    state_saver.py OUT [--steps N] [--crash-rank R] [--bytes B] [--tensors] [--again]

Restores first (``load()`` twice: both must agree), then saves steps from the restored
one + 1 (or 0). Prints, flushed, one line each:

- ``rank R attempt A restored S`` (``none``: nothing to restore), and writes what it
  restored as ``OUT/restored_R_A.json`` (plain) or checks it against ``expected()`` and
  prints ``rank R tensors ok`` (``--tensors``);
- ``rank R attempt A saved S True|False``;
- ``rank R again False`` with ``--again``: a second save of the last step (refused);
- ``refused: MESSAGE`` with ``--bad sparse|subclass``: a tensor snapshots refuse.

``--crash-rank R``: in attempt 0, rank R exits 3 once every rank's saves are complete
(``OUT/done_R_A`` files). ``--hold``: after its
saves, print ``rank R holding`` and wait for ``OUT/go``. ``--bytes B``: the state
also holds B bytes (a full tmpfs, a memory limit). ``--tensors``: the state is
``expected(step)``, tensors of several dtypes and shapes (non-contiguous, aliased,
zero-size), changed in place right after each save returns.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from supervisor import snapshot


def say(text: str) -> None:
    """One write per line: ranks share the console, and under ``-u`` print() writes the
    text and its newline apart, so lines of two ranks could interleave."""
    os.write(1, (text + "\n").encode())


def plain(rank: int, step: int, extra: int) -> dict[str, Any]:
    return {"rank": rank, "step": step, "nested": {"list": [1, 2.5, "x", None, True],
                                                   "tuple": (step, "t")},
            "blob": bytes(extra)}


def expected(step: int) -> dict[str, Any]:
    import torch

    base = torch.arange(24, dtype=torch.float64).reshape(4, 6) + step
    return {
        "base": base,
        "transposed": base.t(),  # non-contiguous, aliases base
        "window": base[1:, 2:],  # an offset into the same storage
        "empty": torch.empty(0, 3),
        "half": torch.full((5,), step, dtype=torch.bfloat16),
        "ints": torch.arange(10, dtype=torch.int8) * step,
        "flags": torch.tensor([True, False]),
        "param": torch.nn.Parameter(torch.ones(3) * step),
        "values": [step, 2.5, "x", None, (3, b"b")],
    }


def check(state: dict[str, Any], step: int) -> None:
    import torch

    want = expected(step)
    for key, value in want.items():
        got = state[key]
        if isinstance(value, torch.Tensor):
            assert type(got) is type(value), key
            assert got.dtype == value.dtype and got.shape == value.shape, key
            assert got.stride() == value.stride() and torch.equal(got, value), key
        else:
            assert got == value, key
    assert state["transposed"].untyped_storage().data_ptr() == (
        state["base"].untyped_storage().data_ptr()), "aliasing lost"


def save_bad(kind: str) -> int:
    """Try to save a tensor snapshots refuse; print ``refused: MESSAGE``."""
    import torch

    class Tagged(torch.Tensor):
        pass

    tensor = (torch.eye(3).to_sparse() if kind == "sparse"
              else torch.ones(2).as_subclass(Tagged))
    try:
        snapshot.save({"w": tensor}, 1)
    except snapshot.SnapshotError as exc:
        say(f"refused: {exc}")
        return 0
    return 1


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--crash-rank", type=int, default=None)
    parser.add_argument("--bytes", type=int, default=0)
    parser.add_argument("--tensors", action="store_true")
    parser.add_argument("--again", action="store_true")
    parser.add_argument("--bad", choices=["sparse", "subclass"], default=None)
    parser.add_argument("--hold", action="store_true")
    args = parser.parse_args()
    if args.bad is not None:
        return save_bad(args.bad)
    rank = int(os.environ.get("RANK", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    first, second = snapshot.load(), snapshot.load()
    assert (first is None) == (second is None) and (first is None or first[0] == second[0])
    restored = None if first is None else first[0]
    say(f"rank {rank} attempt {attempt} restored {restored if first else 'none'}")
    if first is not None and args.tensors:
        check(first[1], first[0])
        say(f"rank {rank} tensors ok")
    elif first is not None:
        (args.out / f"restored_{rank}_{attempt}.json").write_text(
            json.dumps(first[1], default=repr))
    start = 0 if restored is None else restored + 1
    for step in range(start, start + args.steps):
        state = expected(step) if args.tensors else plain(rank, step, args.bytes)
        kept = snapshot.save(state, step)
        if args.tensors:
            for value in state.values():  # the copy was taken: this must not show
                if hasattr(value, "data") and value.numel():
                    value.data.fill_(-1)
        say(f"rank {rank} attempt {attempt} saved {step} {kept}")
    if args.again:
        say(f"rank {rank} again {snapshot.save({'x': 1}, start + args.steps - 1)}")
    snapshot.load()  # returns once this rank's last save is complete (its commit told)
    (args.out / f"done_{rank}_{attempt}").touch()
    if attempt == 0 and rank == args.crash_rank:
        # the crash comes once every rank's saves are complete (the ranks do not train
        # together: a slower rank's save would otherwise be cut by the stop)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        while not all((args.out / f"done_{r}_0").exists() for r in range(world)):
            time.sleep(0.02)  # its own pace: the test waits on output lines, not this
        return 3
    if args.hold:
        say(f"rank {rank} holding")
        while not (args.out / "go").exists():
            time.sleep(0.05)  # its own pace: the test waits on the line above, not this
    return 0


if __name__ == "__main__":
    sys.exit(main())
