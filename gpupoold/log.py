"""Logging set-up: one line per event on stderr, or one journal entry per event.

On a terminal or into a file each line carries its time and level. Under systemd, when stderr is
the journal (`$JOURNAL_STREAM` names stderr's device and inode, as systemd sets it), records go
to journald over its native protocol (systemd.journal-fields(7)): the message, its syslog
priority, and fields the journal indexes: GPUPOOL_LEASE, GPUPOOL_GPU and GPUPOOL_CLIENT where the
record is about a lease, a GPU or a client (`journalctl GPUPOOL_GPU=0`), given by the log call as
`extra=journal_fields(...)`. Where the native socket cannot take a record (it is missing, full,
or the record too large for one datagram) the record goes to stderr with a `<N>` prefix giving
its priority (sd-daemon(3)) on every line (a traceback's continuation lines too), so
`journalctl -u gpupoold -p err` finds the errors either way.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import sys
import unicodedata
from typing import TextIO

# journald's socket for its native protocol.
JOURNAL_SOCKET = "/run/systemd/journal/socket"
# Attributes of a record (set with `extra=journal_fields(...)`) that become journal fields.
RECORD_FIELDS = (("lease_id", "GPUPOOL_LEASE"), ("gpu", "GPUPOOL_GPU"), ("client", "GPUPOOL_CLIENT"))

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


def print_error(text: str, stream: TextIO | None = None) -> None:
    """An error said before logging is set up (a configuration that cannot be read): as it is on
    a terminal, with the error priority on each line in the journal."""
    stream = sys.stderr if stream is None else stream
    mark = f"<{priority(logging.ERROR)}>" if stream_is_journal(stream) else ""
    print("\n".join(mark + line for line in text.split("\n")), file=stream, flush=True)


def journal_fields(lease: int | None = None, gpu: int | None = None,
                   client: str | None = None) -> dict[str, object]:
    """`extra=` for a log call about a lease, a GPU or a client: journal fields under systemd,
    nothing elsewhere (the message says the same in words)."""
    return {k: v for k, v in (("lease_id", lease), ("gpu", gpu), ("client", client))
            if v is not None}


def encode_field(name: str, value: str) -> bytes:
    """One field of the native protocol: `NAME=value\n`, or for a value with a newline
    `NAME\n`, its length as 64-bit little-endian, the value, `\n`."""
    data = value.encode("utf-8", errors="replace")
    if b"\n" in data:
        return name.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
    return name.encode() + b"=" + data + b"\n"


class JournalHandler(logging.Handler):
    """Each record as one datagram to journald: MESSAGE, PRIORITY, SYSLOG_IDENTIFIER, the source
    location, and the record's GPUPOOL_* fields. A record the socket does not take goes to
    `fallback` instead (never lost, never blocking: the socket is non-blocking)."""

    def __init__(self, identifier: str, fallback: logging.Handler, path: str = JOURNAL_SOCKET,
                 prefix: str = "%(name)s: ") -> None:
        super().__init__()
        self.identifier = identifier
        self.fallback = fallback
        self.path = path
        self.setFormatter(logging.Formatter(prefix + "%(message)s"))
        self.sock = socket.socket(socket.AF_UNIX,
                                  socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)

    def entry(self, record: logging.LogRecord) -> bytes:
        fields: list[tuple[str, str | None]] = [
            ("MESSAGE", self.format(record)), ("PRIORITY", str(priority(record.levelno))),
            ("SYSLOG_IDENTIFIER", self.identifier), ("CODE_FILE", record.pathname),
            ("CODE_LINE", str(record.lineno)), ("CODE_FUNC", record.funcName),
            ("GPUPOOL_LOGGER", record.name)]
        for attr, name in RECORD_FIELDS:
            value = getattr(record, attr, None)
            if value is not None:
                fields.append((name, str(value)))
        # A record made by hand may lack its source location: such fields are left out.
        return b"".join(encode_field(k, v) for k, v in fields if v is not None)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            data = self.entry(record)
        except Exception:  # noqa: BLE001 - logging's own convention for a record it cannot format
            self.handleError(record)
            return
        try:
            self.sock.sendto(data, self.path)
        except OSError:  # gone, full (EAGAIN) or too large (EMSGSIZE): stderr still takes it
            self.fallback.handle(record)

    def close(self) -> None:
        self.sock.close()
        self.fallback.close()
        super().close()


def handler(stream: TextIO, text_format: str, datefmt: str | None = None,
            journal_prefix: str = "%(name)s: ", identifier: str = "gpupoold",
            journal_socket: str | None = None) -> logging.Handler:
    """A handler for `stream`: when the stream is the journal, journald's native protocol (the
    `<N>` lines on the stream if its socket is not there or refuses a record); else `text_format`
    (with its time, if it has one)."""
    h = logging.StreamHandler(stream)
    if not stream_is_journal(stream):
        h.setFormatter(logging.Formatter(text_format, datefmt))
        return h
    h.setFormatter(JournalFormatter(journal_prefix))
    journal_socket = JOURNAL_SOCKET if journal_socket is None else journal_socket
    if not os.path.exists(journal_socket):
        return h
    return JournalHandler(identifier, h, journal_socket, journal_prefix)


def setup_logging(level: str) -> None:
    root = logging.getLogger()
    root.handlers[:] = [handler(sys.stderr, "%(asctime)s %(levelname)-7s %(name)s: %(message)s",
                                "%Y-%m-%d %H:%M:%S")]
    root.setLevel(level.upper())
    if level != "debug":
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def printable(text: str) -> str:
    """`text` with every control and format character (C0, C1, DEL; bidirectional overrides and
    other invisible formatting) replaced by '?': what a client says of itself is shown to
    operators and other tenants, in terminals, journals and pages, where an escape sequence
    would act (recolour, retitle, hide text) and a newline would forge a log line."""
    if text.isprintable():
        return text
    return "".join("?" if unicodedata.category(ch) in ("Cc", "Cf") else ch for ch in text)
