"""Test data for ``--preload auto``: reads a per-attempt variable while it imports, so it
must never be preloaded into a standby (which does not have RANK yet)."""

import os

RANK_AT_IMPORT = os.environ.get("RANK", "unset")
