"""The standby's one report, parsed in one place (pure)."""

from __future__ import annotations

from supervisor.workers.warm import reports
from supervisor.workers.warm.reports import Failed, Ready


def test_ready_carries_the_modules_it_could_not_import() -> None:
    assert reports.parse(b"R") == Ready("")
    assert reports.parse(b"Rnumpy (ImportError: x)") == Ready("numpy (ImportError: x)")


def test_a_failure_carries_its_message() -> None:
    assert reports.parse(b"Fpreloading 'x' failed: ImportError: no") == Failed(
        "preloading 'x' failed: ImportError: no")
    assert reports.parse(b"F") == Failed("preloading failed")


def test_a_taint_names_the_package_that_read_a_per_attempt_variable() -> None:
    report = reports.parse(b"FTbadpkg\t'badpkg.sub' reads RANK while it imports")
    assert report == Failed("'badpkg.sub' reads RANK while it imports", tainted="badpkg")


def test_no_report_at_all_means_the_standby_exited() -> None:
    assert reports.parse(b"") == Failed("the standby exited")


def test_the_standby_program_writes_what_the_parser_reads() -> None:
    from supervisor.workers.warm.standby import standby_code

    code = standby_code()
    assert 'b"R"' in code and 'b"F"' in code and 'f"T{top}\\t' in code
    assert reports.READY == b"R" and reports.FAILED == b"F" and reports.TAINTED == "T"
