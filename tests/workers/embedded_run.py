"""``supervisor run ARGS`` the way the embedded Python API runs it (``supervise(...,
embedded=True)``): not a child subreaper, so no fork server, and the standbys that
``--preload`` gives import for themselves (the rule for the API and for a rank whose
environment is not the node's). For the tests of those standbys.

    embedded_run.py ARGS...

SIGTERM cancels the run (the API's caller would cancel it); exits with the run's exit
code, or 128 + SIGTERM.
"""

from __future__ import annotations

import os
import signal
import sys

import anyio

from supervisor.app import supervise
from supervisor.cli import parse_run_args
from supervisor.logsetup import configure_logging
from supervisor.workers.spawn import SPAWNER


async def run(argv: list[str]) -> int:
    env = dict(os.environ)
    settings = parse_run_args(argv, env)
    configure_logging(settings.log_level, settings.log_format)
    code = 128 + signal.SIGTERM
    async with anyio.create_task_group() as tg:
        async def cancel_on_term() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM) as signals:
                async for _ in signals:
                    tg.cancel_scope.cancel()

        tg.start_soon(cancel_on_term)
        code = (await supervise(settings, env, embedded=True)).exit_code
        tg.cancel_scope.cancel()
    return code


if __name__ == "__main__":
    SPAWNER.start()
    try:
        sys.exit(anyio.run(run, sys.argv[1:]))
    finally:
        SPAWNER.stop()
