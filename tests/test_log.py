"""gpupoold's log lines (gpupoold/log.py): time and level on a terminal or in a file; under
systemd, when stderr is the journal ($JOURNAL_STREAM names it), no time of our own and a `<N>`
syslog priority on every line, so `journalctl -p err` finds the errors."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from conftest import REPO, daemon_env

from gpupoold.log import JournalFormatter, priority, stream_is_journal

SCRIPT = """
import logging, sys
from gpupoold.log import setup_logging
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
