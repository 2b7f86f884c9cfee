"""The record spool (issue 34, item 4): the records the store could not write because the
database was unreachable (a lease's end, its scrub, idle-detach events, GPU time, audit) wait in
`<state_dir>/records.spool` until the database is back: on disk, not in memory, so that a daemon
killed during an outage loses none. This module is the one reader and writer of its format; the
store's record spooler (store/replay.py) decides when to spool and replays the records.

Format, version 1: text, one line per record.

    gpupool-spool 1\\n                  the header: the format's name and version
    <crc32, 8 hex digits> <json>\\n      a record: the CRC-32 of the JSON's bytes, then the JSON

The JSON is {"id": a unique id, "call": the store call, "args": [...], "kwargs": {...},
"at": the Unix time it was made}. A record is taken once its line is written and fsync'd. A
crash can tear the last line (no newline, or a checksum that does not match): it is skipped
with a warning, and cut off before the next append so that the next record starts a line of its
own. A damaged line elsewhere is skipped with a warning too; neither is fatal. The store removes
the file only once the database has committed every record in it; a replay that runs twice (a
crash between that commit and the removal) writes each record once, as the database keeps the
ids of the records it took (store/replay.py, `apply_spooled`).

Calls are synchronous file I/O with fsync: the store makes them on a thread of their own, never
on the event loop.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SPOOL_NAME = "records.spool"
FORMAT = "gpupool-spool"
VERSION = 1
HEADER = f"{FORMAT} {VERSION}\n".encode()

log = logging.getLogger("gpupoold.store")


class SpoolError(Exception):
    """The spool file cannot be used (written by a newer gpupoold); the message says what to do."""


@dataclass(frozen=True)
class SpooledRecord:
    """One store call that waits for the database: StoreDB's method `call` with `args` and
    `kwargs` (JSON values), made at `at`; `id` is unique, so that the database takes it once."""

    id: str
    call: str
    args: list[Any]
    kwargs: dict[str, Any] = field(default_factory=dict)
    at: float = 0.0

    @classmethod
    def new(cls, call: str, args: list[Any], kwargs: dict[str, Any]) -> SpooledRecord:
        return cls(uuid.uuid4().hex, call, args, kwargs, time.time())

    def line(self) -> bytes:
        """The record's line in the spool (checksum, JSON, newline)."""
        body = json.dumps({"id": self.id, "call": self.call, "args": self.args,
                           "kwargs": self.kwargs, "at": self.at},
                          separators=(",", ":"), default=str).encode()
        return b"%08x %s\n" % (zlib.crc32(body), body)


@dataclass
class SpoolRead:
    """What `Spool.read` found: each record with the offset just past its line, the offset where
    reading stopped (past the last complete line), and how many lines were skipped as damaged."""

    records: list[tuple[SpooledRecord, int]]
    end: int
    skipped: int


def _parse(line: bytes) -> SpooledRecord | None:
    """A record from its line (without the newline); None when the line is damaged."""
    crc, _, body = line.partition(b" ")
    try:
        if len(crc) != 8 or int(crc, 16) != zlib.crc32(body):
            return None
        obj = json.loads(body)
        return SpooledRecord(id=str(obj["id"]), call=str(obj["call"]), args=list(obj["args"]),
                             kwargs=dict(obj.get("kwargs") or {}), at=float(obj.get("at", 0.0)))
    except (ValueError, KeyError, TypeError):
        return None


class Spool:
    """The spool file at `path`. Not thread-safe: one thread makes every call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.size = 0  # bytes in the file (0: no file)
        self.records = 0  # records appended or found at `open` and not yet removed

    def open(self) -> int:
        """Look at the file a previous run left: check its header, cut off a torn last line
        (with a warning), and count its records; the count. Raises SpoolError for a file of an
        unknown format or version (it is left as it is)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            self.size = self.records = 0
            return 0
        if not data.startswith(HEADER):
            if HEADER.startswith(data):  # torn while being created: it held no record yet
                self.path.unlink()
                self.size = self.records = 0
                return 0
            first = data.split(b"\n", 1)[0][:60].decode(errors="replace")
            raise SpoolError(
                f"{self.path} is not a record spool this gpupoold can read (it starts with "
                f"{first!r}; this one writes '{FORMAT} {VERSION}'): start the gpupoold that wrote "
                f"it to write its records to the database, or move the file away")
        keep = data.rfind(b"\n") + 1
        if keep < len(data):
            log.warning("the record spool %s ends with a torn record (%d bytes, written when "
                        "gpupoold stopped mid-write): skipped", self.path, len(data) - keep)
            with open(self.path, "r+b") as f:
                f.truncate(keep)
                os.fsync(f.fileno())
        self.size = keep
        self.records = sum(1 for line in data[len(HEADER):keep].split(b"\n")[:-1]
                           if _parse(line) is not None)
        return self.records

    def append(self, record: SpooledRecord) -> None:
        """Add a record at the end; it is on disk (fsync'd) when this returns."""
        if self.size == 0:
            self._create()
        line = record.line()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        try:
            written = os.write(fd, line)
            if written != len(line):  # a full disk: the partial line is cut off again
                os.ftruncate(fd, self.size)
                raise OSError(f"short write to {self.path} ({written} of {len(line)} bytes)")
            os.fsync(fd)
        finally:
            os.close(fd)
        self.size += len(line)
        self.records += 1

    def _create(self) -> None:
        """A new spool holding the header only, made whole or not at all (temporary file,
        fsync, rename, fsync of the folder): lease records say who used the GPUs, so 0600."""
        tmp = self.path.with_name(self.path.name + ".new")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            if os.write(fd, HEADER) != len(HEADER):
                raise OSError(f"short write to {tmp}")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        self._sync_folder()
        self.size = len(HEADER)
        self.records = 0

    def read(self, start: int = 0) -> SpoolRead:
        """The records from byte offset `start` (0: the first) to the last complete line."""
        if self.size == 0:
            return SpoolRead([], 0, 0)
        start = max(start, len(HEADER))
        with open(self.path, "rb") as f:
            f.seek(start)
            data = f.read(max(0, self.size - start))
        out: list[tuple[SpooledRecord, int]] = []
        skipped = 0
        offset = start
        for line in data.split(b"\n")[:-1]:  # the part after the last newline is not a line
            offset += len(line) + 1
            record = _parse(line)
            if record is None:
                skipped += 1
                log.warning("the record spool %s has a damaged record at byte %d (its checksum "
                            "does not match): skipped", self.path, offset - len(line) - 1)
                continue
            out.append((record, offset))
        return SpoolRead(out, offset, skipped)

    def remove(self) -> None:
        """Remove the file: the database committed every record in it."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self._sync_folder()
        self.size = self.records = 0

    def _sync_folder(self) -> None:
        fd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def peek(path: Path) -> list[SpooledRecord]:
    """The complete, intact records in the spool at `path` now, read-only (for tools and tests
    that look at a spool a running gpupoold writes; the store itself reads through `Spool`)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    if not data.startswith(HEADER):
        return []
    lines = data[len(HEADER):].split(b"\n")[:-1]
    return [r for r in map(_parse, lines) if r is not None]
