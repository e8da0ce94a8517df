"""The suite's own scheduling: an ``xdist_group`` mark must put a test in its group (the
timing-bound tests of group ``load`` rely on running one at a time). pytest-xdist does it
by renaming the item's node id, which pytest 9 no longer reads: pyproject.toml keeps
pytest below 9, and this test fails if the marks stop taking effect."""

from __future__ import annotations

import pytest


@pytest.mark.xdist_group("suite-probe")
def test_an_xdist_group_mark_puts_the_test_in_its_group(request: pytest.FixtureRequest) -> None:
    if request.config.getoption("dist", "no") != "loadgroup" and \
            not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not run under pytest-xdist --dist loadgroup (README's command is)")
    assert request.node.nodeid.endswith("@suite-probe"), (
        f"{request.node.nodeid}: xdist_group marks are ignored (pytest "
        f"{pytest.__version__}); the suite needs pytest below 9, see pyproject.toml")
