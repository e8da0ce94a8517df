"""What ``--preload auto`` learns from a cold worker (it records nothing): the packages of
the shared objects it mapped, each followed by what that package imports lazily."""

from __future__ import annotations

import subprocess
import sys

import pytest

from supervisor.workers.warm import autopreload


def test_a_package_is_followed_by_what_it_imports_lazily() -> None:
    assert autopreload.with_lazy_imports(["psutil", "torch", "numpy"]) == [
        "psutil", "torch", "torch._dynamo", "numpy"]
    assert autopreload.with_lazy_imports([]) == []


@pytest.mark.torch
def test_a_cold_torch_worker_shows_torch_and_then_dynamo_which_ddp_imports_later() -> None:
    """DDP's constructor imports torch._dynamo (pure Python, so no map shows it) at the
    first step of the warm attempt: without it in the list the first restart pays 1-1.5 s."""
    program = ("import sys, torch; "
               "print('ready', 'torch._dynamo' in sys.modules, flush=True); sys.stdin.read()")
    with subprocess.Popen([sys.executable, "-c", program], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as child:
        assert child.stdout is not None  # leaving the block closes its stdin: it ends
        line = child.stdout.readline()
        names = autopreload.cold_worker_modules(child.pid)
    assert line == "ready False\n"  # importing torch alone does not import it
    assert names[names.index("torch"):][:2] == ["torch", "torch._dynamo"]
