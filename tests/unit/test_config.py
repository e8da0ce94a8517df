"""Configuration layering and validation (pure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.cli import parse_run_args
from supervisor.config import ConfigError, build, from_environ, load_file


def test_precedence_defaults_file_env_flags(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('training_script = "t.py"\nmax_restarts = 1\nrole = "file"\nnnodes = "1"\n')
    env = {"PET_MAX_RESTARTS": "2", "PET_ROLE": "env"}
    s = parse_run_args(["--config", str(cfg), "--role", "flag"], env)
    assert (s.max_restarts, s.role, s.training_script) == (2, "flag", "t.py")
    assert s.shutdown_timeout == 30.0  # default


def test_torchrun_underscore_flags_and_script_args() -> None:
    s = parse_run_args(["--nproc_per_node=4", "--max_restarts", "3", "train.py", "--lr", "0.1",
                        "--nnodes", "7"], {})
    assert s.local_world_size == 4 and s.max_restarts == 3
    assert s.training_script_args == ["--lr", "0.1", "--nnodes", "7"]
    assert s.nnodes == "1:1"  # the script's own --nnodes is not ours


@pytest.mark.parametrize(("layer", "message"), [
    ({"max_restarts": -1}, "max_restarts: must be >= 0"),
    ({"nnodes": "3:2"}, "nnodes"),
    ({"nproc_per_node": "zero"}, "nproc_per_node"),
    ({"restart_backoff": "5:1"}, "restart_backoff"),
    ({"health_port": 70000}, "health_port"),
    ({"rdzv_backend": "zookeeper"}, "rdzv_backend"),
    ({"rdzv_backend": "etcd"}, "rdzv_endpoint"),
    ({"bogus": 1}, "unknown setting 'bogus'"),
    ({"hang_dump": "gdb"}, "hang_dump"),
    ({"loop_nice": 1}, "loop_nice: must be -20..0"),
    ({"loop_nice": -21}, "loop_nice: must be -20..0"),
    ({"no_watchdog": "maybe"}, "no_watchdog: expected a boolean"),
])
def test_bad_values_name_the_key(layer: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        build({"training_script": "t.py"}, layer)
    assert "\n" not in str(info.value)


def test_environment_knobs() -> None:
    raw = from_environ({"TORCHELASTIC_HEALTH_CHECK_PORT": "1234",
                        "TORCHELASTIC_ENABLE_FILE_TIMER": "0", "PET_NNODES": "2:4"})
    assert raw == {"health_port": "1234", "no_watchdog": "1", "nnodes": "2:4"}
    s = build({"training_script": "t.py", "rdzv_backend": "etcd", "rdzv_endpoint": "h:1"}, raw)
    assert (s.health_port, s.no_watchdog, s.min_nodes, s.max_nodes) == (1234, True, 2, 4)


def test_list_settings_from_env_strings() -> None:
    s = build({"training_script": "t.py"}, {"no_restart_exit_codes": "2, 3"})
    assert s.no_restart_exit_codes == [2, 3]


def test_invalid_toml_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("max_restarts = = 3\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_file(bad)
