"""A real PostgreSQL for the tests: `initdb` and `pg_ctl` (Debian's `postgresql` package;
scripts/bootstrap.sh installs it) in a temporary directory, listening on 127.0.0.1 at a free
port, trust authentication for the role `gpupool`, fsync off (test data need not survive a
power cut). One server per test session; each test that wants one gets a database of its own.

initdb refuses to run as root: as root the server runs as the `postgres` system user (the
package creates it) with `runuser`, and its directory belongs to that user.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

ROLE = "gpupool"


def _bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    versions = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return versions[-1] if versions else None


def available() -> str:
    """'' when a server can be started here, else why not."""
    if _bin("initdb") is None or _bin("pg_ctl") is None:
        return "initdb/pg_ctl not found: apt-get install postgresql (scripts/bootstrap.sh does)"
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed: pip install 'psycopg[binary]' (scripts/bootstrap.sh does)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no 'postgres' user to run the server as"
    return ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PgServer:
    def __init__(self, primary: PgServer | None = None) -> None:
        """A fresh cluster; with `primary`, its streaming standby instead (pg_basebackup -R:
        a copy of the primary's data that follows its WAL, read-only until promoted)."""
        self.dir = Path(tempfile.mkdtemp(prefix="gpupool-pg-"))
        self.data = self.dir / "data"
        self.log = self.dir / "server.log"
        self.port = _free_port()
        self._as: list[str] = []
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
            self._as = ["runuser", "-u", "postgres", "--"]
        self._n = 0
        if primary is None:
            self._run(_bin("initdb"), "-D", str(self.data), "-U", ROLE, "-A", "trust", "-E",
                      "UTF8", "--no-sync", "--no-instructions")
        else:  # initdb's trust rules let the role replicate from 127.0.0.1
            self._run(_bin("pg_basebackup"), "-h", "127.0.0.1", "-p", str(primary.port), "-U",
                      ROLE, "-D", str(self.data), "-R", "-X", "stream", "-c", "fast", "--no-sync")
        self.start()

    def _run(self, *cmd: str | None) -> None:
        proc = subprocess.run([*self._as, *(c for c in cmd if c)], capture_output=True,
                              text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(c for c in cmd if c)} failed:\n{proc.stdout}\n"
                               f"{proc.stderr}\n{self._log_text()}")

    def _log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def start(self) -> None:
        opts = (f"-c listen_addresses=127.0.0.1 -p {self.port} -c fsync=off "
                f"-c unix_socket_directories={self.dir} -c max_connections=200")
        self._run(_bin("pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-o", opts, "-w",
                  "-t", "60", "start")

    def stop(self, mode: str = "fast") -> None:
        self._run(_bin("pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")

    def promote(self) -> None:
        """A standby becomes a primary (what Patroni or an operator does on a failover)."""
        self._run(_bin("pg_ctl"), "-D", str(self.data), "-w", "-t", "60", "promote")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{ROLE}@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """A fresh, empty database; its URL."""
        import psycopg

        self._n += 1
        name = f"t{os.getpid()}_{self._n}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def close(self) -> None:
        try:
            self.stop("immediate")
        except (RuntimeError, subprocess.TimeoutExpired):
            pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (self.data / "postmaster.pid").exists():
            time.sleep(0.1)
        shutil.rmtree(self.dir, ignore_errors=True)
