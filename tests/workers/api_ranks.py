"""Functions the Python API's tests run as ranks: a fresh interpreter per rank imports
this module to find them, as multiprocessing's spawn would."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any


def rank_report(scale: int, tag: str) -> dict[str, Any]:
    return {"rank": int(os.environ["RANK"]), "scaled": scale * int(os.environ["RANK"]),
            "tag": tag, "world": int(os.environ["WORLD_SIZE"])}


def fail_on_rank_one(message: str) -> str:
    if os.environ["RANK"] == "1":
        raise ValueError(message)
    return "fine"


def fail_first_attempt() -> tuple[int, int]:
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if restart == 0 and os.environ["RANK"] == "0":
        raise RuntimeError("first attempt fails")
    return int(os.environ["RANK"]), restart


def hang_with_pid(pid_dir: str) -> None:
    # written whole beside the directory, then renamed into it: a reader of the directory
    # never sees a file that is empty or not yet complete
    tmp = Path(pid_dir).parent / f"pid-{os.environ['RANK']}.tmp"
    tmp.write_text(str(os.getpid()))
    tmp.rename(Path(pid_dir, os.environ["RANK"]))
    time.sleep(3600)


def return_unpicklable() -> Any:
    return lambda: None
