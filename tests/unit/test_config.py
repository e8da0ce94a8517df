"""Configuration layering and validation (pure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.cli import parse_run_args
from supervisor.config import ConfigError, build, from_environ, load_file
from supervisor.rendezvous.registry import check_backend


def test_precedence_defaults_file_env_flags(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('training_script = "t.py"\nmax_restarts = 1\nrole = "file"\nnnodes = "1"\n')
    env = {"PET_MAX_RESTARTS": "2", "PET_ROLE": "env"}
    s = parse_run_args(["--config", str(cfg), "--role", "flag"], env)
    assert (s.max_restarts, s.role, s.training_script) == (2, "flag", "t.py")
    assert s.shutdown_timeout == 30.0  # default


def test_the_config_files_script_arguments_reach_the_script(tmp_path: Path) -> None:
    """Regression: `run --config FILE` (what the systemd units run) dropped the file's
    training_script_args: argparse's empty remainder overrode them."""
    cfg = tmp_path / "c.toml"
    cfg.write_text('training_script = "t.py"\ntraining_script_args = ["--lr", "0.1"]\n')
    assert parse_run_args(["--config", str(cfg)], {}).training_script_args == ["--lr", "0.1"]
    flags = parse_run_args(["--config", str(cfg), "other.py", "--x"], {})
    assert (flags.training_script, flags.training_script_args) == ("other.py", ["--x"])


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
        check_backend(build({"training_script": "t.py"}, layer))  # as the CLI and API do
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


# ----------------------------------------------------------------------------- did you mean


@pytest.mark.parametrize(("argv", "suggested"), [
    (["--nprocs-per-node", "2", "train.py"], "did you mean --nproc-per-node?"),
    (["--nprocs_per_node=2", "train.py"], "did you mean --nproc-per-node?"),
    (["--max-restrats", "2", "train.py"], "did you mean --max-restarts?"),
    (["--timeout", "2", "train.py"],
     "did you mean --progress-timeout or --shutdown-timeout?"),
])
def test_an_unknown_flag_gets_the_closest_known_one(
        argv: list[str], suggested: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_run_args(argv, {})
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert f"unrecognized arguments: {argv[0]}" in err and err.endswith(f"; {suggested}\n")
    assert err.count("\n") == 1


def test_an_unknown_flag_like_none_of_ours_gets_no_guess(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_run_args(["--zzzzqqq", "train.py"], {})
    assert "did you mean" not in capsys.readouterr().err


def test_an_unknown_config_key_names_the_file_line_and_closest_keys(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('# the job\ntraining_script = "t.py"\n\n  max_restart = 3\n')
    with pytest.raises(ConfigError) as info:
        load_file(cfg)
    assert str(info.value) == (f"config file {cfg}, line 4: unknown setting 'max_restart'; "
                               "did you mean max_restarts?")


@pytest.mark.parametrize(("text", "line"), [
    ('role = "x"\n"nproc-per-nodes" = 2\n', 2),  # quoted, dash spelling
    ('role = "x"\n\n[nproc_per_nodes]\nx = 1\n', 3),  # a table
    ('role = "x"\nnproc_per_nodes.x = 1\n', 2),  # a dotted key
])
def test_the_line_of_an_unknown_key_is_found_however_it_is_written(
        tmp_path: Path, text: str, line: int) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match=rf", line {line}: unknown setting 'nproc_per_nodes'; "
                                          r"did you mean nproc_per_node\?"):
        load_file(cfg)


def test_an_unknown_key_from_the_python_api_gets_the_closest_keys() -> None:
    with pytest.raises(ConfigError, match=r"unknown setting 'max_restart'; did you mean "
                                          r"max_restarts\?"):
        build({"training_script": "t.py", "max_restart": 1})


def test_a_bad_nproc_per_node_lists_gpu_among_the_accepted_values() -> None:
    with pytest.raises(ConfigError, match="expected a positive integer, cpu, gpu or auto, "
                                          "got 'two'"):
        build({"training_script": "t.py", "nproc_per_node": "two"})
