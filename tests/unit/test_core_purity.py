"""The pure core must not import I/O frameworks (DESIGN: pure core, I/O at the edges)."""

from __future__ import annotations

import ast

from tests.support.paths import REPO

FORBIDDEN = {"anyio", "aiohttp", "psutil", "asyncio", "socket", "subprocess", "trio"}
CORE = REPO / "supervisor" / "core"


def test_core_imports_no_io_frameworks() -> None:
    offenders = []
    for path in CORE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    assert offenders == []
    assert len(list(CORE.glob("*.py"))) >= 4
