"""Pure logic: no anyio, aiohttp, psutil or other I/O imports allowed in this package."""
