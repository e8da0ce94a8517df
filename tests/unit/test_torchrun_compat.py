"""Every torchrun flag is accepted by our parser; real torchrun command lines parse the same."""

from __future__ import annotations

import pytest

from supervisor.cli import _run_parser, parse_run_args
from tests.support import deps
from tests.support.torchrun_lines import command_lines

deps.need_module("torch")  # skips with how to install it (fails under .ci/run)
pytestmark = pytest.mark.torch

def torchrun_parser():  # type: ignore[no-untyped-def]
    from torch.distributed.run import get_args_parser

    return get_args_parser()


def test_every_torchrun_option_string_is_ours() -> None:
    ours = {s for a in _run_parser()._actions for s in a.option_strings}
    theirs = {s for a in torchrun_parser()._actions for s in a.option_strings}
    assert theirs - ours == set()


@pytest.mark.parametrize("argv", command_lines(), ids=lambda a: " ".join(a)[:60])
def test_real_command_lines_parse_like_torchrun(argv: list[str]) -> None:
    theirs = torchrun_parser().parse_args(argv)
    ours = parse_run_args(argv, {})
    assert ours.training_script == theirs.training_script
    assert ours.training_script_args == theirs.training_script_args
    assert ours.nproc_per_node == str(theirs.nproc_per_node)
    assert ours.nnodes == str(theirs.nnodes) or (ours.nnodes, theirs.nnodes) == ("1:1", "1:1")
    assert ours.max_restarts == int(theirs.max_restarts)
    assert ours.rdzv_backend == theirs.rdzv_backend
    assert ours.rdzv_endpoint == theirs.rdzv_endpoint
    assert ours.node_rank == int(theirs.node_rank)
    assert ours.master_addr == theirs.master_addr
    assert ours.module == theirs.module and ours.no_python == theirs.no_python
    assert ours.redirects == str(theirs.redirects) and ours.tee == str(theirs.tee)
    assert ours.role == theirs.role


def test_a_logs_specs_plugin_is_refused_with_one_line() -> None:
    from supervisor.config import ConfigError

    with pytest.raises(ConfigError, match="LogsSpecs plugins are not supported; use log_dir"):
        parse_run_args(["--logs-specs", "my_specs", "train.py"], {})
