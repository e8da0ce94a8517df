"""Waiting on state another thread or process changes, where there is no event to await."""

from __future__ import annotations

from collections.abc import Callable

import anyio


async def until(check: Callable[[], object], timeout: float = 10.0) -> None:
    """Return once ``check()`` is true; fail after ``timeout`` s (polled every 10 ms)."""
    with anyio.fail_after(timeout):
        while not check():
            await anyio.sleep(0.01)  # pacing: the state has no event of its own
