"""A preload that blocks on the FIFO ``PRELOAD_GATE`` until a test opens it. Before, it
writes ``PID TID`` (the importing process's pid and thread id) to the file
``PRELOAD_IDS`` if set (the file appears complete or not at all), then opens
``PRELOAD_STARTED`` if set (a file it creates, or a FIFO the test reads)."""

import _thread
import os

if os.environ.get("PRELOAD_IDS"):
    ids = os.environ["PRELOAD_IDS"]
    with open(ids + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {_thread.get_native_id()}")
    os.rename(ids + ".tmp", ids)
if os.environ.get("PRELOAD_STARTED"):
    open(os.environ["PRELOAD_STARTED"], "w").close()
open(os.environ["PRELOAD_GATE"]).close()
