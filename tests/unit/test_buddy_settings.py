"""--snapshot-port and --snapshot-replicate-rate: defaults, values, one-line refusals."""

from __future__ import annotations

import pytest

from supervisor.cli import parse_run_args
from supervisor.config import ConfigError


def test_the_defaults_are_a_fixed_port_and_no_rate_bound() -> None:
    settings = parse_run_args(["train.py"], {})
    assert settings.snapshot_port == 29481 and settings.replicate_rate is None


def test_port_zero_and_a_rate_with_a_unit() -> None:
    settings = parse_run_args(["--snapshot-port", "0", "--snapshot-replicate-rate", "200M",
                               "train.py"], {})
    assert settings.snapshot_port == 0 and settings.replicate_rate == 200 << 20


@pytest.mark.parametrize(("argv", "message"), [
    (["--snapshot-port", "70000"], "snapshot_port: must be 0..65535"),
    (["--snapshot-replicate-rate", "fast"], "snapshot_replicate_rate: expected a size"),
])
def test_bad_values_are_one_line(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_run_args([*argv, "train.py"], {})
