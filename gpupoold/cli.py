"""The `gpupoold` command line. Subcommands: serve (more with issue 4: token, status, gpu).

The flags of `serve` are generated from the settings that declare one (settings.py), so a flag
and its config key always mean the same thing.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gpupoold import __version__
from gpupoold.config import ConfigError, load_settings
from gpupoold.settings import DEFAULT_CONFIG, iter_flags


def _flag_type(info_type: Any) -> Callable[[str], Any]:
    """The argparse converter of a setting's type (lists have no flag)."""
    return info_type if info_type in (int, float, Path) else str


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpupoold", description="gpupool daemon: lends this server's GPUs to remote clients.")
    parser.add_argument("--version", action="version", version=f"gpupoold {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    serve = sub.add_parser(
        "serve", help="run the daemon (remoting listener + HTTP API)",
        description="Run the daemon. Flags override the config file (docs/configuration.md).")
    serve.add_argument("--config", type=Path, metavar="PATH",
                       help=f"TOML config file (default {DEFAULT_CONFIG}, if it exists)")
    for info in iter_flags():
        serve.add_argument(info.flag, dest=info.name, type=_flag_type(info.base_type),
                           metavar=info.metavar, default=None,
                           help=f"{info.help} [setting `{info.name}`]".replace("%", "%%"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        overrides = {info.name: getattr(args, info.name) for info in iter_flags()}
        try:
            settings = load_settings(args.config, overrides)
        except ConfigError as exc:
            print(f"gpupoold: error: {exc}", file=sys.stderr)
            return 1
        from gpupoold.log import setup_logging
        from gpupoold.serve import run

        setup_logging(settings.log_level)
        return run(settings)
    raise AssertionError(args.command)  # pragma: no cover - argparse allows no other command
