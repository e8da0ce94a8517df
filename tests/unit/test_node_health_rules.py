"""The node health rules (core.nodehealth): pure, no event loop."""

from __future__ import annotations

from supervisor.core import nodehealth as nh

EXIT1 = nh.Signature("exited", local_rank=0, exit_code=1)
LIMITS = nh.Limits(max_node_failures=2, window=100.0, max_quarantined=1)


def failure(at: float, sig: nh.Signature = EXIT1, round: int = 0) -> nh.NodeFailure:
    return nh.NodeFailure(at=at, round=round, signature=sig, description=sig.describe())


def record(node: str, *ats: float, sig: nh.Signature = EXIT1,
           held: bool = False) -> nh.NodeRecord:
    rec = nh.NodeRecord(node, failures=tuple(failure(a, sig) for a in ats))
    return nh.quarantined(rec, "bad", 0.0) if held else rec


def test_below_k_counts_against_the_budget() -> None:
    verdict = nh.judge(record("a", 10.0), [], LIMITS, now=11.0)
    assert verdict.verdict is nh.Verdict.COUNT
    assert "1/2" in verdict.reason


def test_k_failures_in_the_window_quarantine_the_node() -> None:
    verdict = nh.judge(record("a", 10.0, 20.0), [record("b")], LIMITS, now=21.0)
    assert verdict.quarantine
    assert "round 0: local rank 0 exited with code 1" in verdict.reason
    assert len(verdict.failures) == 2


def test_failures_older_than_the_window_do_not_count() -> None:
    verdict = nh.judge(record("a", 10.0, 120.0), [], LIMITS, now=121.0)
    assert verdict.verdict is nh.Verdict.COUNT
    assert verdict.failures == (failure(120.0),)


def test_with_failure_drops_what_left_the_window() -> None:
    rec = nh.with_failure(record("a", 1.0, 50.0), failure(140.0), now=140.0, window=100.0,
                          member="a:1")
    assert [f.at for f in rec.failures] == [50.0, 140.0]
    assert rec.member == "a:1"


def test_a_failure_that_follows_the_rank_is_the_jobs() -> None:
    other = record("b", 15.0)  # the same local rank and exit code on another node
    verdict = nh.judge(record("a", 10.0, 20.0), [other], LIMITS, now=21.0)
    assert verdict.verdict is nh.Verdict.FOLLOWS_RANK
    assert "follows the rank" in verdict.reason


def test_a_different_failure_elsewhere_does_not_excuse_the_node() -> None:
    other = record("b", 15.0, sig=nh.Signature("signaled", local_rank=0, signal=9))
    assert nh.judge(record("a", 10.0, 20.0), [other], LIMITS, now=21.0).quarantine


def test_an_old_failure_elsewhere_does_not_excuse_the_node() -> None:
    other = record("b", 1.0)
    assert nh.judge(record("a", 110.0, 120.0), [other], LIMITS, now=121.0).quarantine


def test_the_cap_stops_a_second_quarantine() -> None:
    held = record("b", held=True)
    verdict = nh.judge(record("a", 10.0, 20.0), [held], LIMITS, now=21.0)
    assert verdict.verdict is nh.Verdict.CAPPED
    assert "b" in verdict.reason


def test_a_cap_of_zero_never_quarantines() -> None:
    limits = nh.Limits(max_node_failures=1, max_quarantined=0)
    assert nh.judge(record("a", 10.0), [], limits, now=11.0).verdict is nh.Verdict.CAPPED


def test_limits_off_always_count() -> None:
    verdict = nh.judge(record("a", 1.0, 2.0, 3.0), [], nh.Limits(), now=4.0)
    assert verdict.verdict is nh.Verdict.COUNT


def test_a_failure_of_another_node_is_remote() -> None:
    cause = nh.RoundCause("b", 3, EXIT1, at=1.0)
    assert nh.is_remote(cause, "a")
    assert not nh.is_remote(cause, "b")


def test_warn_when_k_cannot_be_reached_within_the_budget() -> None:
    assert nh.start_warnings(nh.Limits(max_node_failures=3), max_restarts=1)
    assert not nh.start_warnings(nh.Limits(max_node_failures=3), max_restarts=2)
    assert not nh.start_warnings(nh.Limits(), max_restarts=0)


def test_bad_limits_are_named() -> None:
    problems = nh.check_limits(nh.Limits(max_node_failures=-1, window=0, max_quarantined=-2))
    assert [p.split(":")[0] for p in problems] == [
        "max_node_failures", "node_failure_window", "max_quarantined"]


def test_a_passing_check_is_reused_within_the_interval() -> None:
    passed = nh.CheckResult(True, "", at=100.0)
    assert nh.check_is_fresh(passed, 150.0, interval=60.0)
    assert not nh.check_is_fresh(passed, 161.0, interval=60.0)
    assert nh.check_is_fresh(passed, 10_000.0, interval=0.0)
    assert not nh.check_is_fresh(nh.CheckResult(False, "x", at=100.0), 101.0, 60.0)
    assert not nh.check_is_fresh(None, 1.0, 60.0)


def test_the_reason_is_the_first_non_empty_line_bounded() -> None:
    out = b"\n  \n\x1b[31mGPU 3: XID 79\x1b[0m\nmore\n"
    assert nh.first_line(out) == "?[31mGPU 3: XID 79?[0m"
    assert len(nh.first_line(b"x" * 10_000)) == nh.MAX_TEXT
    assert nh.check_failure_reason(1, False, 60, out).startswith("node check exited with code 1")
    assert nh.check_failure_reason(None, True, 5, b"") == "node check timed out after 5 s"


def test_the_disk_check_needs_a_writable_directory_with_free_space() -> None:
    assert nh.disk_verdict(nh.MIN_FREE_BYTES, True, "/l") == ""
    assert "MiB free" in nh.disk_verdict(nh.MIN_FREE_BYTES - 1, True, "/l")
    assert "not writable" in nh.disk_verdict(10**12, False, "/l")
