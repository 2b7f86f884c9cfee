"""What workers leave under `state_dir/workers/` for the next gpupoold (0700, the daemon's user
only): one pid file per worker this daemon started, the adoption socket of each session that can
outlive the daemon (`lease-ID.sock`, worker/adopt.c) and the end record of a session that ended
while no daemon followed it (`lease-ID.end`).

A new gpupoold reads it to take over (pool/leases.py) and to kill the workers of a previous daemon
that hold nothing worth keeping. The blocking methods run in a thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import time
from pathlib import Path

import gpupool_protocol as gp

from gpupoold.workers import control

log = logging.getLogger("gpupoold.workers")

WORKER_DIR = "workers"
SUN_PATH_MAX = 107  # bytes of a Unix socket path, without its NUL
KILL_WAIT = 5.0  # seconds for killed orphans to go


def worker_dir(state_dir: Path) -> Path:
    """The folder under a state directory."""
    return state_dir / WORKER_DIR


def adoption_socket(folder: Path, lease_id: int) -> Path:
    """The socket a lease's worker listens on for a new gpupoold (worker/adopt.c)."""
    return folder / f"lease-{lease_id}.sock"


def adoption_end_record(folder: Path, lease_id: int) -> Path:
    """The worker_ended frame a worker leaves when its session ended with no daemon following
    it."""
    return folder / f"lease-{lease_id}.end"


class WorkerDir:
    def __init__(self, state_dir: Path) -> None:
        self.path = worker_dir(state_dir)

    def prepare(self, adoptable: bool) -> None:
        """Create it, private; warn when its paths are too long for adoption sockets."""
        self.path.mkdir(mode=0o700, exist_ok=True)
        with contextlib.suppress(OSError):
            os.chmod(self.path, 0o700)
        longest = adoption_socket(self.path, (1 << 64) - 1)
        if adoptable and len(bytes(longest)) > SUN_PATH_MAX:
            log.warning("state_dir %s is too long for the workers' adoption sockets (%d of at "
                        "most %d bytes): leases will end when gpupoold stops; choose a shorter "
                        "state_dir", self.path.parent, len(bytes(longest)), SUN_PATH_MAX)

    def socket(self, lease_id: int) -> Path:
        return adoption_socket(self.path, lease_id)

    def note_pid(self, pid: int, gpu_index: int) -> None:
        with contextlib.suppress(OSError):
            self.path.mkdir(exist_ok=True)
            (self.path / str(pid)).write_text(str(gpu_index))

    def forget_pid(self, pid: int) -> None:
        with contextlib.suppress(OSError):
            (self.path / str(pid)).unlink()

    def end_record(self, lease_id: int) -> gp.WorkerEnded | None:
        """The worker_ended frame the lease's worker left (None: none, or unreadable: logged)."""
        path = adoption_end_record(self.path, lease_id)
        try:
            msg = control.decode(path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, gp.ProtocolError) as exc:
            log.warning("ignoring the unreadable end record %s: %s", path, exc)
            return None
        if not isinstance(msg, gp.WorkerEnded):
            log.warning("ignoring the end record %s: it holds %s, not worker_ended", path,
                        type(msg).NAME)
            return None
        return msg

    def forget_lease(self, lease_id: int) -> None:
        """The lease is closed: its end record and a stale socket go."""
        for stale in (adoption_end_record(self.path, lease_id), adoption_socket(self.path, lease_id)):
            with contextlib.suppress(OSError):
                stale.unlink(missing_ok=True)

    def kill_orphans(self, keep: set[int]) -> None:
        """Kill the workers a previous gpupoold left running, except `keep` (those whose leases
        are being taken over), and wait (up to KILL_WAIT) until they are gone."""
        if not self.path.is_dir():
            return
        killed = []
        for entry in self.path.iterdir():
            if not re.fullmatch(r"[0-9]+", entry.name) or int(entry.name) in keep:
                continue  # adoption sockets and end records are the takeover's
            with contextlib.suppress(OSError):
                entry.unlink()
            pid = int(entry.name)
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue  # gone already
            if b"gpupool-worker" not in cmdline:
                continue  # the pid was reused by something else
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        deadline = time.monotonic() + KILL_WAIT
        for pid in killed:
            while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
                stat = Path(f"/proc/{pid}/stat")
                with contextlib.suppress(OSError):
                    if stat.read_text().split(") ")[-1].startswith("Z"):
                        break  # a zombie holds no GPU; its parent (gone) cannot reap it
                time.sleep(0.02)
        if killed:
            log.warning("killed %d worker(s) left by a previous gpupoold: %s", len(killed),
                        ", ".join(map(str, killed)))
