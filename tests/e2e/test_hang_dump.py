"""``--hang-dump py-spy`` as installed (issue 18, item 12): py-spy in the venv, the supervisor
started by the venv's interpreter path with a PATH that lacks the venv (as the systemd
unit does). The tool is resolved at start-up, a py-spy that cannot work is refused with
one line and exit 2, and the dump of a real hang names the hung function."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from supervisor.watchdog.escalate import CAP_SYS_PTRACE, find_py_spy, ptrace_refusal
from tests.support.daemon import supervisor
from tests.support.paths import REPO, WORKERS

VENV_BIN = Path(sys.executable).parent
WAIT = 30.0
BARE_PATH = "/usr/local/bin:/usr/bin:/bin"  # no venv on it

needs_py_spy = pytest.mark.skipif(
    not (VENV_BIN / "py-spy").is_file(),
    reason="py-spy is not installed next to the interpreter "
           "(pip install 'elastic-supervisor[hang-dump]')",
)

HUNG = (WORKERS / "hung_for_dump.py").read_text()


def bare_env() -> dict[str, str]:
    """A PATH without the venv; our tree importable (the venv's editable install is main's)."""
    return {"PATH": BARE_PATH, "PYTHONPATH": str(REPO)}


def test_py_spy_is_found_on_path_first(tmp_path: Path) -> None:
    tool = tmp_path / "py-spy"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    assert find_py_spy(str(tmp_path), sys.executable) == str(tool)


@needs_py_spy
def test_py_spy_is_found_next_to_the_interpreter() -> None:
    assert find_py_spy(BARE_PATH, sys.executable) == str(VENV_BIN / "py-spy")


def test_no_py_spy_anywhere(tmp_path: Path) -> None:
    assert find_py_spy(str(tmp_path), str(tmp_path / "bin" / "python")) is None


PTRACE = 1 << CAP_SYS_PTRACE


@pytest.mark.parametrize(
    ("scope", "euid", "caps", "file_caps", "allowed"),
    [
        (None, 1000, (0, 0), False, True),  # no Yama: same uid is enough
        (0, 1000, (0, 0), False, True),
        (1, 1000, (PTRACE, 0), False, False),  # a user gets only ambient capabilities
        (1, 1000, (PTRACE, PTRACE), False, True),  # AmbientCapabilities=CAP_SYS_PTRACE
        (1, 0, (PTRACE, 0), False, True),  # root: the bounding set
        (2, 0, (0, 0), False, False),  # root in a container without CAP_SYS_PTRACE
        (2, 1000, (0, 0), True, True),  # setcap cap_sys_ptrace+ep py-spy
        (3, 0, (PTRACE, PTRACE), True, False),  # no ptrace at all
    ],
)
def test_ptrace_permission(
    scope: int | None, euid: int, caps: tuple[int, int], file_caps: bool, allowed: bool
) -> None:
    refusal = ptrace_refusal(scope, euid, caps, file_caps)
    assert (refusal is None) == allowed
    if refusal is not None:
        assert f"ptrace_scope={scope}" in refusal and "\n" not in refusal


@needs_py_spy
async def test_dump_names_the_hung_function_with_py_spy_found_beside_the_interpreter(
    tmp_path: Path,
) -> None:
    """Regression: with the venv off PATH, py-spy was looked up on PATH only: the dump
    failed with ENOENT and left an empty hang-PID.txt."""
    script = tmp_path / "hung.py"
    script.write_text(HUNG)
    logs = tmp_path / "logs"
    args = ["--nproc-per-node", "1", "--max-restarts", "0", "--hang-dump", "py-spy",
            "--log-dir", str(logs), str(script)]
    launcher = [str(VENV_BIN / "python"), "-m", "supervisor", "run"]  # by its absolute path
    async with supervisor(args, env=bare_env(), launcher=launcher) as sup:
        await sup.err.expect(rf"hang dumps by {VENV_BIN / 'py-spy'}$")
        pid = int((await sup.out.expect(r"^ready (\d+)$")).group(1))
        await sup.err.expect(rf"hang dump of pid {pid} saved to ", timeout=WAIT)
        assert await sup.wait(WAIT) != 0  # the hung rank was killed: the job failed
    dump = (logs / "none" / "attempt_0" / "0" / f"hang-{pid}.txt").read_text()
    assert f"Process {pid}" in dump
    assert "stuck_in_the_named_function" in dump
    assert "py-spy dump of pid" not in sup.err.text()  # no "... failed: ..." line


def fake_venv(root: Path) -> Path:
    """A venv of our interpreter without py-spy: its python, pyvenv.cfg, site-packages."""
    real = Path(sys.prefix)
    (root / "bin").mkdir(parents=True)
    (root / "pyvenv.cfg").write_text((real / "pyvenv.cfg").read_text())
    lib = f"python{sys.version_info.major}.{sys.version_info.minor}"
    (root / "lib" / lib).mkdir(parents=True)
    (root / "lib" / lib / "site-packages").symlink_to(real / "lib" / lib / "site-packages")
    python = root / "bin" / "python"
    python.symlink_to(Path(sys.executable).resolve())
    return python


@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="needs the tests to run in a venv")
async def test_py_spy_that_cannot_be_found_is_refused_at_start(tmp_path: Path) -> None:
    python = fake_venv(tmp_path / "venv")
    args = ["--hang-dump", "py-spy", "--log-dir", str(tmp_path / "logs"), "-m", "json.tool"]
    async with supervisor(args, env=bare_env(),
                          launcher=[str(python), "-m", "supervisor", "run"]) as sup:
        assert await sup.wait(WAIT) == 2
    lines = sup.err.text().splitlines()
    assert lines == [
        f"elastic-supervisor: config error: hang_dump: py-spy not found on PATH or in "
        f"{python.parent} (pip install 'elastic-supervisor[hang-dump]')"
    ]
    assert not sup.out.lines
