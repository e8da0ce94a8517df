"""``run --help``: the torchrun flags that change nothing are under their own heading."""

from __future__ import annotations

from supervisor.cli import _run_parser, parse_run_args

IGNORED = ("--monitor-interval", "--event-log-handler", "--logs-specs", "--signals-to-handle")


def test_ignored_torchrun_flags_have_their_own_heading() -> None:
    text = _run_parser().format_help()
    used, heading, ignored = text.partition("torchrun flags accepted and ignored:")
    assert heading
    for flag in IGNORED:
        assert flag in ignored and flag not in used, flag
    assert "--nnodes" in used and "--nnodes" not in ignored


def test_ignored_torchrun_flags_are_still_accepted() -> None:
    settings = parse_run_args(["--monitor-interval", "5", "--event-log-handler", "console",
                               "--signals-to-handle", "SIGTERM", "train.py"], {})
    assert (settings.monitor_interval, settings.training_script) == (5.0, "train.py")
