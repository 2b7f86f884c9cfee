"""Settings from the TOML config file plus command-line overrides.

Precedence: defaults < config file < flags. A missing default config file is fine; a config file
named with --config must exist. Any bad file, unknown key or bad value raises ConfigError with a
message naming the file and the key, and gpupoold does not start.
"""

from __future__ import annotations

import tomllib
import typing
from pathlib import Path
from typing import Any

from gpupoold.config.settings import (
    DEFAULT_CONFIG,
    SettingInfo,
    Settings,
    settings_conflict,
    settings_info,
)


class ConfigError(Exception):
    """A configuration problem; the message says where and what."""


# The exit status of `gpupoold serve` when its configuration cannot work (sysexits.h EX_CONFIG):
# the unit's RestartPreventExitStatus=78 stops systemd from restarting it every RestartSec with
# the same error, and leaves the unit failed with the message in the journal.
EX_CONFIG = 78


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def coerce(info: SettingInfo, value: Any, where: str) -> Any:
    """A value from TOML (or a flag) converted to the setting's type, or ConfigError."""
    want = info.base_type
    bad = ConfigError(f"{where}: setting '{info.name}': expected {_type_name(want)}, "
                      f"got {_describe(value)}")
    if want is bool:
        if not isinstance(value, bool):
            raise bad
    elif want is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
    elif want is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise bad
        value = float(value)
    elif want is str:
        if not isinstance(value, str):
            raise bad
    elif want is Path:
        if not isinstance(value, str | Path) or str(value) == "":
            raise bad
        value = Path(value)
    elif typing.get_origin(want) is list:
        (item,) = typing.get_args(want)
        if not isinstance(value, list) or not all(
                isinstance(v, item) and not isinstance(v, bool) for v in value):
            raise bad
        value = list(value)
    else:  # pragma: no cover - a setting of a type this parser does not know
        raise TypeError(f"setting {info.name}: unsupported type {want}")
    return value


def _type_name(t: Any) -> str:
    if typing.get_origin(t) is list:
        item = typing.get_args(t)[0]
        return f"a list of {item.__name__} values"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
             Path: "a path (string)"}
    return names.get(t, str(t))


def read_config_file(path: Path, required: bool) -> dict[str, Any]:
    """The raw TOML table of the config file ({} when an optional file is missing)."""
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        if required:
            raise ConfigError(f"{path}: config file not found") from None
        return {}
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc.strerror}") from None


def load_settings(config: Path | None = None, overrides: dict[str, Any] | None = None,
                  ) -> Settings:
    """Defaults, then the config file (`config`, or the default path if it exists), then the
    overrides (setting name -> value; None values are ignored)."""
    path = config if config is not None else DEFAULT_CONFIG
    raw = read_config_file(path, required=config is not None)
    known = {info.name: info for info in settings_info()}
    values: dict[str, Any] = {}
    for key, value in raw.items():
        info = known.get(key)
        if info is None:
            hint = f"; did you mean '{key.replace('-', '_')}'?" if key.replace(
                "-", "_") in known else ""
            raise ConfigError(f"{path}: unknown setting '{key}'{hint} "
                              "(see docs/configuration.md)")
        values[key] = coerce(info, value, str(path))
    for key, value in (overrides or {}).items():
        if value is not None:
            values[key] = coerce(known[key], value, "command line")
    for key, value in values.items():
        check = known[key].check
        if check is not None:
            try:
                check(value)
            except ValueError as exc:
                where = "command line" if overrides and overrides.get(key) is not None else path
                raise ConfigError(f"{where}: setting '{key}': {exc}") from None
    conflict = settings_conflict(values)
    if conflict is not None:
        raise ConfigError(f"{path}: {conflict}")
    return Settings(**values)
