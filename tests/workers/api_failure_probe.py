"""Launches a failing command through ``supervisor.launch`` in a process that never imported
torch, and reports what it caught, for the ChildFailedError tests.

    api_failure_probe.py LOG_DIR

Prints ``caught CLASSES`` (the exception's MRO, by name) and ``torch imported: BOOL``.
"""

import sys

import supervisor

try:
    supervisor.launch({"log_dir": sys.argv[1], "health_port": 0, "rdzv_id": "probe"},
                      sys.executable, "-c", "raise SystemExit(3)")
except supervisor.WorkerGroupFailed as exc:
    print("caught", " ".join(c.__name__ for c in type(exc).__mro__))
print("torch imported:", any(name.partition(".")[0] == "torch" for name in sys.modules))
