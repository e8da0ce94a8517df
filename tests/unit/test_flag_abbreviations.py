"""Abbreviated long flags: expanded before the script as torchrun's argparse would, never
in the script's own arguments (supervisor.abbrev)."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from supervisor.abbrev import TORCHRUN_FLAGS, AmbiguousFlag, expand_abbreviations
from supervisor.cli import _run_parser, _takes_value, parse_run_args
from tests.support import deps


def ours(argv: list[str]) -> list[str]:
    return expand_abbreviations(argv, _takes_value(_run_parser()))


def test_pytorchs_redirect_prefix_means_redirects() -> None:
    settings = parse_run_args(["--redirect=3", "--tee=3", "--no-python", "/bin/true"], {})
    assert settings.redirects == "3" and settings.tee == "3"


def test_a_prefix_with_a_separate_value() -> None:
    settings = parse_run_args(["--nproc", "2", "--max", "1", "train.py"], {})
    assert (settings.local_world_size, settings.max_restarts) == (2, 1)


def test_underscore_and_dash_spellings_are_one_flag() -> None:
    assert ours(["--nproc_per", "2", "train.py"]) == ["--nproc-per-node", "2", "train.py"]


def test_torchruns_flags_win_over_ours() -> None:
    # --re also starts --ready-when and --restart-*, which torchrun does not have
    assert ours(["--re", "3", "train.py"]) == ["--redirects", "3", "train.py"]


def test_a_prefix_of_our_own_flags_only() -> None:
    assert ours(["--ready", "launched", "train.py"]) == ["--ready-when", "launched", "train.py"]


def test_an_ambiguous_prefix_names_the_candidates() -> None:
    with pytest.raises(AmbiguousFlag, match=r"--r could match --rdzv-backend, .*--role, "
                                            r"--run-path$"):
        ours(["--r", "3", "train.py"])
    with pytest.raises(AmbiguousFlag, match="--restart-backoff, --restart-budget-window"):
        ours(["--restart", "1", "train.py"])


def test_an_ambiguous_prefix_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_run_args(["--rdzv", "x", "train.py"], {})
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ambiguous option: --rdzv could match --rdzv-backend" in err[0]


@pytest.mark.parametrize("script_args", [["--log", "1"], ["--max", "3"], ["--nproc=2"],
                                         ["--re", "x", "--", "--tee"]])
def test_the_scripts_arguments_reach_it_as_given(script_args: list[str]) -> None:
    settings = parse_run_args(["--nproc", "1", "train.py", *script_args], {})
    assert settings.training_script == "train.py"
    assert settings.training_script_args == script_args


def test_nothing_after_a_double_dash_is_expanded() -> None:
    settings = parse_run_args(["--no-python", "--", "/bin/echo", "--max", "3"], {})
    assert settings.training_script_args == ["--max", "3"]


def test_a_flags_value_is_never_taken_for_a_flag() -> None:
    assert ours(["--role", "--re", "train.py"]) == ["--role", "--re", "train.py"]
    assert ours(["-r", "3", "--max", "1", "train.py"]) == ["-r", "3", "--max-restarts", "1",
                                                         "train.py"]


def test_unknown_flags_are_left_to_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_run_args(["--bogus", "train.py"], {})
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


# ----------------------------------------------------------------------------- torch's parser


def torchrun_parser() -> argparse.ArgumentParser:
    run: Any = deps.need_module("torch.distributed.run")
    parser: argparse.ArgumentParser = run.get_args_parser()
    return parser


@pytest.mark.torch
def test_our_copy_of_torchruns_flags_is_torchs() -> None:
    theirs = {o.removeprefix("--").replace("_", "-")
              for a in torchrun_parser()._actions for o in a.option_strings if o[:2] == "--"}
    assert theirs == TORCHRUN_FLAGS


def _accepted_by_torchrun(parser: argparse.ArgumentParser, argv: list[str],
                          before: dict[str, Any]) -> str | None:
    """The dest torchrun's parser gives ``argv``'s first flag, None if it refuses it."""
    try:
        after = vars(parser.parse_args(argv))
    except SystemExit:
        return None
    changed = [k for k in after if after[k] != before[k] and k != "training_script"]
    return changed[0] if changed else None


# our own flags are exact names, which win over a prefix (docs/torchrun-compat.md)
OWN_FLAGS_THAT_ARE_TORCHRUN_PREFIXES = {"--event-log", "--event_log"}


@pytest.mark.torch
def test_every_prefix_torchrun_takes_means_the_same_flag_here(
        capsys: pytest.CaptureFixture[str]) -> None:
    theirs = torchrun_parser()
    theirs.print_usage = lambda file=None: None  # type: ignore[method-assign]  # 1000s of refusals
    before = vars(theirs.parse_args(["train.py"]))
    mine = _run_parser()
    table = _takes_value(mine)
    checked = 0
    for action in theirs._actions:
        if action.nargs == 0 and action.const is None and action.dest == "help":
            continue
        value = [] if action.nargs == 0 else ["7"]
        for option in (o for o in action.option_strings if o.startswith("--")):
            for end in range(3, len(option)):
                argv = [option[:end], *value, "train.py"]
                if _accepted_by_torchrun(theirs, argv, before) != action.dest:
                    continue  # ambiguous for torchrun (e.g. both spellings match)
                if argv[0] in OWN_FLAGS_THAT_ARE_TORCHRUN_PREFIXES:
                    continue
                expanded = expand_abbreviations(argv, table)
                assert vars(mine.parse_args(expanded)).keys() >= {action.dest}, argv
                checked += 1
    capsys.readouterr()  # torchrun's parser printed its refusals
    assert checked > 100  # the enumeration really ran over torchrun's flags
