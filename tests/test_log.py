"""gpupoold's log lines (gpupoold/log.py): time and level on a terminal or in a file; under
systemd, when stderr is the journal ($JOURNAL_STREAM names it), no time of our own and a `<N>`
syslog priority on every line, so `journalctl -p err` finds the errors."""

from __future__ import annotations

import io
import logging
import os
import socket
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

from conftest import REPO, daemon_env

from gpupoold.log import (
    JournalFormatter,
    JournalHandler,
    journal_fields,
    print_error,
    priority,
    stream_is_journal,
)
from gpupoold.workers.supervisor import worker_line

SCRIPT = """
import logging, sys
import gpupoold.log
from gpupoold.log import setup_logging
gpupoold.log.JOURNAL_SOCKET = "/nonexistent/journal"  # the stream form, even where journald runs
setup_logging("info")
log = logging.getLogger("gpupoold.test")
log.info("started")
log.warning("careful")
log.error("broken")
try:
    raise ValueError("boom")
except ValueError:
    log.exception("with a traceback")
logging.getLogger("gpupoold.test").debug("not shown at info")
"""


def run_logging(journal: bool) -> list[str]:
    """The script's stderr lines, with stderr a file that JOURNAL_STREAM names (journal) or
    does not."""
    with tempfile.TemporaryFile() as err:
        st = os.fstat(err.fileno())
        env = daemon_env({"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}" if journal else
                          f"{st.st_dev}:{st.st_ino + 1}"})
        subprocess.run([sys.executable, "-c", SCRIPT], stderr=err, env=env, cwd=REPO,
                       check=True, timeout=60)
        err.seek(0)
        return err.read().decode().splitlines()


def test_lines_for_the_journal() -> None:
    lines = run_logging(journal=True)
    assert lines[:3] == ["<6>gpupoold.test: started", "<4>gpupoold.test: careful",
                         "<3>gpupoold.test: broken"]
    # Every line of the traceback is an error too.
    rest = lines[3:]
    assert rest[0] == "<3>gpupoold.test: with a traceback" and len(rest) > 3
    assert all(line.startswith("<3>") for line in rest), rest
    assert rest[-1] == "<3>ValueError: boom"
    assert not any("not shown" in line for line in lines)


def test_lines_elsewhere_have_time_and_level() -> None:
    lines = run_logging(journal=False)  # JOURNAL_STREAM names another file: not the journal
    assert lines[0].endswith(" INFO    gpupoold.test: started") and lines[0][:4].isdigit()
    assert not any(line.startswith("<") for line in lines)


def test_priorities_and_detection(tmp_path: Path) -> None:
    assert [priority(n) for n in (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR,
                                  logging.CRITICAL)] == [7, 6, 4, 3, 2]
    with open(tmp_path / "f", "w") as f:
        st = os.fstat(f.fileno())
        assert stream_is_journal(f, {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"})
        for value in ("", "x:y", f"{st.st_dev}", f"{st.st_dev}:{st.st_ino + 1}"):
            assert not stream_is_journal(f, {"JOURNAL_STREAM": value}), value
    record = logging.LogRecord("n", logging.WARNING, "f", 1, "a\nb", None, None)
    assert JournalFormatter().format(record) == "<4>n: a\n<4>b"
    assert JournalFormatter("").format(record) == "<4>a\n<4>b"


def parse_entry(data: bytes) -> dict[str, str]:
    """journald's native protocol, read back: `NAME=value` lines, or NAME, a 64-bit length and
    the value for values with newlines."""
    fields, i = {}, 0
    while i < len(data):
        nl = data.index(b"\n", i)
        line = data[i:nl]
        if b"=" in line:
            name, _, value = line.partition(b"=")
            i = nl + 1
        else:
            name = line
            (size,) = struct.unpack("<Q", data[nl + 1:nl + 9])
            value = data[nl + 9:nl + 9 + size]
            assert data[nl + 9 + size:nl + 10 + size] == b"\n"
            i = nl + 10 + size
        fields[name.decode()] = value.decode()
    return fields


def test_native_journal_entries(tmp_path: Path) -> None:
    path = str(tmp_path / "journal.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(path)
    fallback = io.StringIO()
    h = JournalHandler("gpupoold", logging.StreamHandler(fallback), path)
    log = logging.getLogger("gpupoold.test.native")
    log.addHandler(h)
    log.propagate = False
    try:
        log.warning("lease %d ended (%s)", 7, "expired", extra=journal_fields(7, 1, "bo@pc pid 9"))
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("GPU %d: the scrub failed", 1, extra=journal_fields(gpu=1))
        first = parse_entry(server.recv(65536))
        second = parse_entry(server.recv(65536))
    finally:
        log.removeHandler(h)
        h.close()
        server.close()
    assert first["MESSAGE"] == "gpupoold.test.native: lease 7 ended (expired)"
    assert first["PRIORITY"] == "4" and first["SYSLOG_IDENTIFIER"] == "gpupoold"
    assert (first["GPUPOOL_LEASE"], first["GPUPOOL_GPU"], first["GPUPOOL_CLIENT"]) == \
        ("7", "1", "bo@pc pid 9")
    assert first["CODE_FUNC"] == "test_native_journal_entries" and first["CODE_LINE"].isdigit()
    # A traceback stays in its one entry (the length-prefixed form), at the error priority.
    assert second["PRIORITY"] == "3" and "GPUPOOL_LEASE" not in second
    assert second["MESSAGE"].startswith("gpupoold.test.native: GPU 1: the scrub failed\nTraceback")
    assert second["MESSAGE"].endswith("ValueError: boom")
    assert fallback.getvalue() == ""


def test_records_the_journal_socket_refuses_go_to_stderr(tmp_path: Path) -> None:
    fallback = io.StringIO()
    stream = logging.StreamHandler(fallback)
    stream.setFormatter(JournalFormatter())
    h = JournalHandler("gpupoold", stream, str(tmp_path / "no-journald-here"))
    record = logging.LogRecord("gpupoold.x", logging.ERROR, "f", 1, "broken", None, None)
    h.handle(record)
    h.close()
    assert fallback.getvalue() == "<3>gpupoold.x: broken\n"


def test_errors_before_logging_carry_the_priority_in_the_journal(tmp_path: Path) -> None:
    with open(tmp_path / "err", "w+") as f:
        st = os.fstat(f.fileno())
        os.environ["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
        try:
            print_error("gpupoold: error: bad\nsecond line", f)
        finally:
            del os.environ["JOURNAL_STREAM"]
        print_error("gpupoold: error: plain", f)
        f.seek(0)
        assert f.read() == ("<3>gpupoold: error: bad\n<3>second line\n"
                            "gpupoold: error: plain\n")


def test_worker_lines_keep_their_priority() -> None:
    assert worker_line("<3>gpupool-worker[5]: out of memory at start") == \
        (logging.ERROR, "gpupool-worker[5]: out of memory at start")
    assert worker_line("<4>gpupool-worker[5]: keepalive: x") == \
        (logging.WARNING, "gpupool-worker[5]: keepalive: x")
    assert worker_line("gpupool-worker[5]: client said goodbye") == \
        (logging.INFO, "gpupool-worker[5]: client said goodbye")
    assert worker_line("<7>debug")[0] == logging.DEBUG
    assert worker_line("<x>not a mark") == (logging.INFO, "<x>not a mark")
