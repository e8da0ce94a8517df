"""Optional test dependencies: skip with a reason that says how to get them, or fail.

A test that needs something a fresh machine lacks (torch, etcd, prometheus, haproxy, a C
compiler, root) asks for it here, or carries the matching marker (``@pytest.mark.torch``
...: ``tests/conftest.py`` then asks for it before the test runs). When it is missing the
test is skipped with a reason naming the install command, so README's test command passes
on a fresh clone.

``ELASTIC_SUPERVISOR_REQUIRE_DEPS=1`` (set by ``.ci/run``) turns every such skip into a
failure: with everything installed, no test may skip silently.
"""

from __future__ import annotations

import importlib
import os
import shutil
from types import ModuleType
from typing import NoReturn

import pytest

REQUIRE_ENV = "ELASTIC_SUPERVISOR_REQUIRE_DEPS"
PREFIX = "missing dependency: "  # every skip made here starts with it (conftest's net)

# what each marker needs, and how to get it
MODULES = {"torch": ("torch", "pip install torch==2.13.0 (.ci/run does)")}
BINARIES = {
    "etcd": ("etcd", "apt-get install etcd-server etcd-client (.ci/run does)"),
    "prometheus": ("prometheus", "apt-get install prometheus (.ci/run does)"),
    "haproxy": ("haproxy", "apt-get install haproxy (.ci/run does)"),
    "compiler": ("cc", "apt-get install gcc (.ci/run does)"),
}


def required() -> bool:
    """Whether a missing dependency fails the test instead of skipping it."""
    return os.environ.get(REQUIRE_ENV, "") not in ("", "0")


def missing(what: str) -> NoReturn:
    """Skip (or, under ELASTIC_SUPERVISOR_REQUIRE_DEPS=1, fail) for a missing ``what``:
    a sentence that says what is missing and how to get it."""
    reason = PREFIX + " ".join(what.split())  # one line, whatever an error's text held
    if required():
        pytest.fail(f"{reason} [{REQUIRE_ENV}=1]", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def need_module(name: str, how: str | None = None) -> ModuleType:
    """Import ``name`` or skip/fail saying ``how`` to install it."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        error = str(exc)
    top = name.partition(".")[0]
    hint = how or MODULES.get(top, (top, f"pip install {top}"))[1]
    missing(f"cannot import {name} ({error}); {hint}")  # outside `except`: no chained report


def need_binary(name: str, how: str | None = None) -> str:
    """The path of executable ``name`` on PATH, or skip/fail saying ``how`` to get it."""
    path = shutil.which(name)
    if path is None:
        hint = how or next((h for b, h in BINARIES.values() if b == name), f"install {name}")
        missing(f"{name} is not on PATH; {hint}")
    return path


def need_marker(marker: str) -> None:
    """What ``@pytest.mark.MARKER`` declares (see MODULES and BINARIES)."""
    if marker in MODULES:
        need_module(*MODULES[marker])
    elif marker in BINARIES:
        need_binary(*BINARIES[marker])
