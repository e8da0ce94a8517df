"""Footprint: import aiohttp's ``frozenlist`` dependency without its C++ extension.

``frozenlist``'s compiled extension is the only C++ code the supervisor would load; it maps
``libstdc++`` (~0.9 MiB resident) for a class aiohttp uses a handful of times at start-up
(its signal lists, frozen once). The pure-Python class has the same API. Import this module
before the first ``import aiohttp``; it sets ``FROZENLIST_NO_EXTENSIONS`` (frozenlist's own,
documented switch) only around that import, so workers never see it, and respects a value
the user set.
"""

from __future__ import annotations

import os
import sys

_SWITCH = "FROZENLIST_NO_EXTENSIONS"

if "frozenlist" not in sys.modules and _SWITCH not in os.environ:
    os.environ[_SWITCH] = "1"
    try:
        import frozenlist  # noqa: F401
    finally:
        del os.environ[_SWITCH]
