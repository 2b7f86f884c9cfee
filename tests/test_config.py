"""Settings, the config file parser and the CLI flags (gpupoold/config/settings.py, config.py, cli.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from config_listing import check_lists_every_setting

from gpupoold.cli import build_parser
from gpupoold.config import file as config_mod
from gpupoold.config.file import ConfigError, load_settings
from gpupoold.config.settings import Settings, format_address, parse_address, settings_info


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gpupoold.toml"
    path.write_text(text)
    return path


def test_defaults_without_a_config_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(config_mod, "DEFAULT_CONFIG", tmp_path / "missing.toml")
    settings = load_settings()
    assert settings == Settings()
    assert settings.listen == "0.0.0.0:7070"
    assert settings.http == "127.0.0.1:7071"
    assert settings.effective_cache_dir == settings.state_dir / "cache"


def test_config_file_then_flags(tmp_path: Path) -> None:
    path = write(tmp_path, 'listen = "127.0.0.1:9000"\nsimulated = 3\ngpus = [0, 1]\n'
                           'stop_grace = 2\nstate_dir = "/tmp/x"\n')
    settings = load_settings(path, {"simulated": 2, "listen": None})
    assert settings.listen == "127.0.0.1:9000"  # None: the flag was not given
    assert settings.simulated == 2  # the flag wins over the file
    assert settings.gpus == [0, 1]
    assert settings.stop_grace == 2.0 and isinstance(settings.stop_grace, float)
    assert settings.state_dir == Path("/tmp/x")


@pytest.mark.parametrize(("text", "named"), [
    ("bogus = 1\n", "unknown setting 'bogus'"),
    ("state-dir = '/x'\n", "did you mean 'state_dir'"),
    ("listen = 7070\n", "setting 'listen': expected a string"),
    ("listen = 'localhost'\n", "setting 'listen': 'localhost' is not HOST:PORT"),
    ("http = '::1:80'\n", "setting 'http'"),
    ("simulated = true\n", "setting 'simulated': expected an integer"),
    ("simulated = -1\n", "setting 'simulated': must be 0 or more"),
    ("gpus = [0, 'a']\n", "setting 'gpus': expected a list of int values"),
    ("gpus = [1, 1]\n", "setting 'gpus': must be distinct GPU indices"),
    ("sim_name = 'H100'\n", "setting 'sim_name': must contain the word 'simulated'"),
    ("log_level = 'loud'\n", "setting 'log_level': must be one of"),
    ("handshake_timeout = 0\n", "setting 'handshake_timeout': must be greater than 0"),
    ("sim_memory_gib = 0\n", "setting 'sim_memory_gib': must be from 1 to 16384"),
    ("[listen]\nport = 1\n", "setting 'listen': expected a string"),
    ("share = 0\n", "setting 'share': must be from 1 (whole GPUs) to 64"),
    ("share = 65\n", "setting 'share': must be from 1 (whole GPUs) to 64"),
    ("share = 4\nshare_gpus = [0, 0]\n", "setting 'share_gpus': must be distinct GPU indices"),
    ("share_gpus = [1]\n", "set share = 2 or more"),
    ("share = 4\nshare_mps = 'nvidia-mps'\n", "setting 'share_mps': must be an absolute path"),
    ("share = 4\nshare_mps = '/nonexistent/gpupool-mps'\n",
     "/nonexistent/gpupool-mps is not a directory: start the MPS control daemon first"),
    ("share_mps = '/'\n", "'share' is 1 (whole GPUs): set share = 2 or more, or remove share_mps"),
    ("share = 2\ndatabase = 'postgresql://db.example/gpupool'\n",
     "shares are not served in a fleet. Set share = 1 on the fleet's servers"),
    ("listen = \n", "not valid TOML"),
])
def test_bad_config_names_the_key(tmp_path: Path, text: str, named: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    assert named in str(info.value)
    assert str(path) in str(info.value)


def test_missing_explicit_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_settings(tmp_path / "nope.toml")


def test_bad_flag_value_is_reported_as_command_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="command line: setting 'listen'"):
        load_settings(write(tmp_path, ""), {"listen": "nowhere"})


def test_cli_flags_map_to_settings() -> None:
    args = build_parser().parse_args([
        "serve", "--simulated", "2", "--listen", "127.0.0.1:0", "--http", "[::1]:0",
        "--state-dir", "/tmp/s", "--worker", "/w", "--sim-lib", "/s.so", "--config", "/c.toml"])
    assert args.command == "serve"
    assert args.simulated == 2 and args.listen == "127.0.0.1:0" and args.http == "[::1]:0"
    assert args.state_dir == Path("/tmp/s") and args.worker == Path("/w")
    assert args.sim_lib == Path("/s.so") and args.config == Path("/c.toml")
    assert build_parser().parse_args(["serve"]).simulated is None  # unset flags override nothing


def test_cli_rejects_a_non_number(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", "--simulated", "many"])
    assert info.value.code == 2
    assert "--simulated" in capsys.readouterr().err


def test_every_setting_has_help_and_a_known_type() -> None:
    for info in settings_info():
        assert info.help.strip(), info.name
        assert info.base_type in (str, int, float, bool, Path, list[int], list[str]), info.name


@pytest.mark.parametrize(("text", "expected"), [
    ("0.0.0.0:7070", ("0.0.0.0", 7070)),
    ("[::1]:0", ("::1", 0)),
    ("localhost:65535", ("localhost", 65535)),
])
def test_parse_address(text: str, expected: tuple[str, int]) -> None:
    assert parse_address(text) == expected
    assert parse_address(format_address(*expected)) == expected


@pytest.mark.parametrize("text", ["7070", ":7070", "host:", "host:99999", "::1:80", "h:x"])
def test_parse_address_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_address(text)


def test_packaged_config_lists_every_setting(tmp_path: Path) -> None:
    """The .deb's /etc/gpupoold/gpupoold.toml (its source here; tests/test_debs.py checks the
    built package's copy) lists every setting with its default: a new setting without its line
    fails here, not only in the slow package tests."""
    text = (Path(__file__).parent.parent / "packaging" / "debian" / "gpupoold.toml").read_text()
    check_lists_every_setting(text, tmp_path)


def test_shared_gpus_settings(tmp_path: Path) -> None:
    settings = load_settings(write(tmp_path, "share = 4\nshare_gpus = [1, 2]\n"))
    assert (settings.share, settings.share_gpus) == (4, [1, 2])
    assert (Settings().share, Settings().share_gpus) == (1, [])


def test_share_mps_names_an_existing_pipe_directory(tmp_path: Path) -> None:
    """Issue 32, item 4: MPS is off unless the operator names its control daemon's pipes."""
    pipes = tmp_path / "mps-pipes"
    pipes.mkdir()
    settings = load_settings(write(tmp_path, f"share = 2\nshare_mps = '{pipes}'\n"))
    assert settings.share_mps == str(pipes)
    assert Settings().share_mps == ""
