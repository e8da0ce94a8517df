"""Where the tests' files are."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
REPO = TESTS.parent
WORKERS = TESTS / "workers"
DATA = TESTS / "data"
FAKE_WORKER = str(WORKERS / "fake_worker.py")
