"""A rank that plants a FIFO at the path of its own hang dump, then hangs past its deadline
(issue 52, finding 2): the supervisor's ``--hang-dump py-spy`` must not open it."""

import os
import time
from pathlib import Path

from supervisor.worker import expires

rank_dir = Path(os.environ["TORCHELASTIC_ERROR_FILE"]).parent
os.mkfifo(rank_dir / f"hang-{os.getpid()}.txt")
with expires(after=0.5, scope="step"):
    os.write(1, f"ready {os.getpid()}\n".encode())
    time.sleep(3600)
