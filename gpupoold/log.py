"""Logging set-up: one line per event on stderr, with time and level."""

from __future__ import annotations

import logging
import sys


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        "%(asctime)s %(levelname)-7s %(name)s: %(message)s", "%Y-%m-%d %H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    if level != "debug":
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
