"""What the supervisor hands its two child programs (the fork server's and a spawned
standby's) besides their own text: the child-side preload module they share.

Both programs run from their files' text (``python -u -c TEXT``) and import nothing of
ours (``interpreter`` says why); ``childpreload`` reaches them the same way, as its text
and file name, which each program runs in a module object of its own (``load_module`` in
each: a module that is not in ``sys.modules``, so the user's code never sees it).
"""

from __future__ import annotations

import functools
from pathlib import Path

PRELOAD_MODULE = Path(__file__).with_name("childpreload.py")


@functools.cache
def preload_source() -> tuple[str, str]:
    """``childpreload``'s text and file name (for the child's tracebacks)."""
    return PRELOAD_MODULE.read_text(encoding="utf-8"), str(PRELOAD_MODULE)
