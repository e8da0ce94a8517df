"""A hostile worker: replaces every file the supervisor may open in its run, attempt and
rank directories with a FIFO (issue 52, finding 2), then prints ``planted`` and sleeps.

``rm events.jsonl; mkfifo events.jsonl`` and the same for its own ``stdout.log`` and
``stderr.log``, the hang dump it would get (``hang-PID.txt``) and the ``--preload auto``
lists (``.preload-auto.json.PID`` and ``preload-auto.json``). Nobody ever reads them.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path


def plant(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path, 0o600)


def main() -> None:
    rank_dir = Path(os.environ["TORCHELASTIC_ERROR_FILE"]).parent
    run_dir = rank_dir.parent.parent
    supervisor = os.getppid()  # the death-signal wrapper exec'd us: its parent is ours
    for path in (run_dir / "events.jsonl", rank_dir / "stdout.log", rank_dir / "stderr.log",
                 rank_dir / f"hang-{os.getpid()}.txt", run_dir / f".preload-auto.json.{supervisor}",
                 run_dir / "preload-auto.json"):
        plant(path)
    os.write(1, b"planted\n")
    signal.pause()


if __name__ == "__main__":
    main()
