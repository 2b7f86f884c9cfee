"""Logging set-up: one line per event on stderr.

On a terminal or into a file each line carries its time and level. Under systemd, when stderr is
the journal (`$JOURNAL_STREAM` names stderr's device and inode, as systemd sets it), the journal
adds the time itself, and a `<N>` prefix gives each line its syslog priority (sd-daemon(3)), so
`journalctl -u gpupoold -p err` finds the errors; every line of a multi-line record (a traceback)
gets the prefix, or its continuation lines would be logged as info.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

# sd-daemon(3) priorities of the logging levels.
PRIORITIES = ((logging.CRITICAL, 2), (logging.ERROR, 3), (logging.WARNING, 4),
              (logging.INFO, 6))
DEBUG_PRIORITY = 7


def priority(levelno: int) -> int:
    """The syslog priority of a logging level."""
    for level, prio in PRIORITIES:
        if levelno >= level:
            return prio
    return DEBUG_PRIORITY


def stream_is_journal(stream: TextIO, env: dict[str, str] | None = None) -> bool:
    """True when `stream` is connected to the journal: $JOURNAL_STREAM ("DEV:INODE") names it.
    Checking the inode, not only the variable, keeps a process whose stderr was redirected
    (a shell pipe, a test capturing it) from writing prefixes to whatever reads it."""
    value = (os.environ if env is None else env).get("JOURNAL_STREAM", "")
    dev, _, ino = value.partition(":")
    try:
        st = os.fstat(stream.fileno())
        return dev.isdigit() and ino.isdigit() and (st.st_dev, st.st_ino) == (int(dev), int(ino))
    except (OSError, ValueError, AttributeError):
        return False


class JournalFormatter(logging.Formatter):
    """`<N>name: message`, the prefix on every line of the record."""

    def __init__(self, prefix: str = "%(name)s: ") -> None:
        super().__init__(prefix + "%(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        mark = f"<{priority(record.levelno)}>"
        return "\n".join(mark + line for line in text.split("\n"))


def handler(stream: TextIO, text_format: str, datefmt: str | None = None,
            journal_prefix: str = "%(name)s: ") -> logging.Handler:
    """A handler for `stream`: the journal's format when the stream is the journal, else
    `text_format` (with its time, if it has one)."""
    h = logging.StreamHandler(stream)
    if stream_is_journal(stream):
        h.setFormatter(JournalFormatter(journal_prefix))
    else:
        h.setFormatter(logging.Formatter(text_format, datefmt))
    return h


def setup_logging(level: str) -> None:
    root = logging.getLogger()
    root.handlers[:] = [handler(sys.stderr, "%(asctime)s %(levelname)-7s %(name)s: %(message)s",
                                "%Y-%m-%d %H:%M:%S")]
    root.setLevel(level.upper())
    if level != "debug":
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
