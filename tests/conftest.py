"""Suite-wide hooks and fixtures: a marker per layer, declared dependencies, etcd.

Helpers live in ``tests/support/`` (see tests/README.md); fixtures every layer may use are
here, so no test module imports another.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import deps
from tests.support.etcd import EtcdFactory, EtcdMember, etcd_factory
from tests.support.paths import TESTS
from tests.support.watchdog import Freezer

# Bytecode is cached even where the environment says not to (PYTHONDONTWRITEBYTECODE=1, as
# in some containers and CI images): the suite starts hundreds of supervisors, guardians
# and workers, and each compiled the package from source again (0.55 s of CPU for a
# supervisor's start instead of 0.35 s); pytest's rewritten test modules are cached too.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
# No test needs the system's CA certificates (the TLS tests bring their own CA), and
# loading them cost every supervisor start ~50 ms of CPU: aiohttp builds its default SSL
# context when it is imported. Processes the suite starts get an empty bundle instead.
os.environ["SSL_CERT_FILE"] = os.devnull

# tests/<layer>/... gets the marker <layer>: `-m unit` runs what `tests/unit` holds
LAYERS = {
    "unit": "pure logic: no event loop, no processes (tests/unit)",
    "component": "real processes, sockets or servers, but not the whole daemon (tests/component)",
    "e2e": "the daemon end to end (tests/e2e)",
}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# ------------------------------------------------------------------------------ xdist


@pytest.hookimpl(optionalhook=True)  # xdist's hook: unknown where xdist is not loaded
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: two workers more than the CPUs this process may run on. Most tests
    wait on processes, sockets and timers (three workers kept two cores 78 % busy); the
    tests that hold a timing bound still run one at a time, in xdist group ``load``, the
    network-namespace tests in ``netns`` and the torch jobs in ``torch``."""
    return len(os.sched_getaffinity(0)) + 2


# ---------------------------------------------------------------- optional dependencies


def pytest_configure(config: pytest.Config) -> None:
    for layer, what in LAYERS.items():
        config.addinivalue_line("markers", f"{layer}: {what}")
    for marker, (_, how) in {**deps.MODULES, **deps.BINARIES}.items():
        config.addinivalue_line("markers", f"{marker}: needs {marker} ({how})")


@pytest.fixture(autouse=True)
def _declared_dependencies(request: pytest.FixtureRequest) -> None:
    """A marker such as ``@pytest.mark.torch`` is a dependency: skip (with how to get
    it) or, under ELASTIC_SUPERVISOR_REQUIRE_DEPS=1, fail before the test body runs."""
    for marker in request.node.iter_markers():
        deps.need_marker(marker.name)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(TESTS):  # not so for a suite that loads this as a plugin
            layer = item.path.relative_to(TESTS).parts[0]
            if layer in LAYERS:
                item.add_marker(layer)


# ---------------------------------------------------------------------------- etcd


@pytest.fixture
def factory(tmp_path: Path) -> Iterator[EtcdFactory]:
    """Starts etcd members (one or a cluster) for this test; stops them after it."""
    (tmp_path / "etcd").mkdir()
    with etcd_factory(tmp_path / "etcd") as made:
        yield made


@pytest.fixture
def server(factory: EtcdFactory) -> EtcdMember:
    """One etcd member of this test's own."""
    return factory.single()


# ------------------------------------------------------------------ D state


@pytest.fixture
def freezer() -> Iterator[Freezer]:
    """A cgroup v1 freezer whose members sleep in D state; thawed and removed after."""
    root = Path("/sys/fs/cgroup/freezer")
    if not (root / "cgroup.procs").is_file() or not os.access(root, os.W_OK):
        pytest.skip("needs a writable cgroup v1 freezer at /sys/fs/cgroup/freezer (root) to "
                    "put a process in D state; the FUSE fallback is not implemented")
    made = Freezer(root)
    yield made
    made.release(wait=10.0)


# skip reasons that mean "something is not installed", whoever raised them
_DEPENDENCY_SKIP = re.compile(
    "^" + re.escape(deps.PREFIX) + r"|could not import|No module named|not installed"
)


def _fail_dependency_skip(report: pytest.CollectReport | pytest.TestReport) -> None:
    """Under ELASTIC_SUPERVISOR_REQUIRE_DEPS=1 no dependency skip passes, even one made by
    a bare ``pytest.importorskip`` or ``pytest.skip`` that bypassed tests/support/deps.py."""
    if not (report.skipped and deps.required()) or hasattr(report, "wasxfail"):
        return
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    if _DEPENDENCY_SKIP.search(reason):
        report.outcome = "failed"
        report.longrepr = f"{reason} [{deps.REQUIRE_ENV}=1: dependency skips fail]"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    _fail_dependency_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    _fail_dependency_skip(outcome.get_result())
