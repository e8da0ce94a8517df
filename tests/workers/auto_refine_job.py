"""A job for ``--preload auto``'s second lesson: a pure-Python import a cold worker's
shared libraries do not show.

    auto_refine_job.py OUT_DIR

Records the modules it finds at its start in ``OUT_DIR/r<restart>_<local rank>.json``,
then imports ``psutil`` (an extension module: seen in a cold worker's maps) and
``iniconfig`` (pure Python: only a warm worker's record of its imports shows it), and
exits 1 once ``OUT_DIR/go<restart>`` exists on restarts 0 and 1, 0 at once on restart 2.
"""

import sys

_MODULES_AT_START = sorted(sys.modules)  # before this script imported anything

import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402

import iniconfig  # noqa: E402, F401
import psutil  # noqa: E402, F401

restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
out = sys.argv[1]
path = os.path.join(out, f"r{restart}_{os.environ['LOCAL_RANK']}.json")
with open(path + ".tmp", "w") as f:
    json.dump({"modules_at_start": _MODULES_AT_START}, f)
os.replace(path + ".tmp", path)
if restart >= 2:
    sys.exit(0)
gate = os.path.join(out, f"go{restart}")
deadline = time.monotonic() + 120
while not os.path.exists(gate) and time.monotonic() < deadline:
    time.sleep(0.01)
sys.exit(1)
