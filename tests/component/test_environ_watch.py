"""The environment watch that the fork server and every spawned standby share
(``childpreload.watch_environ``): a preloaded module that uses a per-attempt name by any
method that looks it up or changes it, on ``os.environ``, ``os.environb`` or a copy of
them, is seen; copies and iterations alone are not. Each case runs in a fresh
interpreter (``tests/workers/environ_watch.py``), as the child programs do."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from supervisor.workers.warm import programs, standby
from supervisor.workers.warm.forkserver import bootstrap_argv
from tests.support.paths import WORKERS

WATCHER = str(WORKERS / "environ_watch.py")
USES = {
    "environ_pop": "import os\nos.environ.pop('RANK', None)\n",
    "environ_setdefault": "import os\nos.environ.setdefault('RANK', '0')\n",
    "environ_set": "import os\nos.environ['RANK'] = '0'\n",
    "environ_del": "import os\ntry:\n    del os.environ['RANK']\nexcept KeyError:\n    pass\n",
    "environ_update": "import os\nos.environ.update(RANK='0')\n",
    "environb_pop": "import os\nos.environb.pop(b'RANK', None)\n",
    "copy_pop": "import os\nos.environ.copy().pop('RANK', None)\n",
    "copy_setdefault": "import os\nos.environ.copy().setdefault('RANK', '0')\n",
    "copy_set": "import os\nenv = os.environ.copy()\nenv['RANK'] = '0'\n",
    "copy_update": "import os\nenv = os.environ.copy()\nenv |= {'RANK': '0'}\n",
    "copy_of_copy_get": "import os\nos.environ.copy().copy().get('RANK')\n",
}
HARMLESS = "import os\nenv = os.environ.copy()\nnames = list(env) + list(os.environ.items())\n"


def used(snippet: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    done = subprocess.run(
        [sys.executable, WATCHER, str(programs.PRELOAD_MODULE), "RANK,LOCAL_RANK", snippet],
        env=env, capture_output=True, text=True, timeout=60, check=True)
    reads: list[str] = json.loads(done.stdout)
    return reads


@pytest.mark.parametrize("how", sorted(USES))
def test_every_method_that_uses_a_watched_name_is_seen(how: str) -> None:
    assert used(USES[how])[:1] == ["RANK"]


def test_copies_and_iterations_alone_use_no_watched_name() -> None:
    assert used(HARMLESS) == []


def test_the_fork_server_and_the_spawned_standby_run_the_same_module() -> None:
    source, filename = programs.preload_source()
    assert filename.endswith("childpreload.py")
    assert repr(source) in standby.standby_code()
    assert repr(source) in bootstrap_argv(["python", "-u"])[-1]
