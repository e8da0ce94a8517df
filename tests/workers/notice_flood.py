"""An attacker of the health port: N connections that each send the headers of a
``POST /leave-notice`` and never its body, and reconnect as soon as the server closes them.

    python notice_flood.py PORT N

Prints ``ready`` once all N have sent their headers, then floods until killed; prints
``connections M`` (how many it opened) on SIGTERM.
"""

from __future__ import annotations

import asyncio
import signal
import sys

HEADERS = (b"POST /leave-notice HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Content-Length: 100\r\n\r\n")


async def attacker(port: int, sent: asyncio.Event, opened: list[int]) -> None:
    while True:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.01)  # the server's queue is full: try again at once
            continue
        opened[0] += 1
        try:
            writer.write(HEADERS)
            await writer.drain()
            sent.set()
            await reader.read()  # until the server closes it
        except OSError:
            pass
        finally:
            writer.close()


async def main(port: int, count: int) -> None:
    opened = [0]
    events = [asyncio.Event() for _ in range(count)]
    tasks = [asyncio.create_task(attacker(port, sent, opened)) for sent in events]
    for sent in events:
        await sent.wait()
    print("ready", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    for task in tasks:
        task.cancel()
    print(f"connections {opened[0]}", flush=True)


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
