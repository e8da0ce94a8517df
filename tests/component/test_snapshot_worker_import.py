"""The worker side of snapshots is light to import (it runs in the job's environment)."""

from __future__ import annotations

import subprocess
import sys


def test_the_worker_side_imports_none_of_the_supervisors_dependencies() -> None:
    """``supervisor.snapshot`` runs in the job's environment: no anyio, aiohttp, psutil,
    msgspec there, and torch only once a tensor is seen."""
    probe = ("import sys, supervisor.snapshot\n"
             "print(sorted(m for m in ('anyio', 'aiohttp', 'psutil', 'msgspec', 'torch') "
             "if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True, timeout=60)
    assert done.stdout.strip() == "[]"
