"""A worker's process as the daemon holds it: started by this gpupoold, or adopted from an
earlier one.

Workers outlive their daemon (worker/adopt.c), so a gpupoold must follow processes that are not
its children. Both kinds are watched the same way, through a pidfd (Linux 5.3): it becomes
readable when the process ends, and signals sent through it can never reach a process that took
over a recycled pid. For our own children the exit status is read (reaped) then; an adopted worker
is someone else's child, so its status stays unknown (its `end` event says why it ended).

We start workers with `subprocess.Popen` rather than asyncio's subprocess API on purpose: asyncio
kills a child whose transport is closed or collected, which is exactly what must not happen to a
worker whose lease continues across a daemon restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from pathlib import Path

POLL_INTERVAL = 0.25  # seconds, when the kernel has no pidfd (then /proc is polled)


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (start time in ticks): tells a recycled pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else None


def _alive(pid: int, start: str | None) -> bool:
    """Running (not a zombie) and still the same process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat.rsplit(")", 1)[-1].split()
    return bool(fields) and fields[0] != "Z" and (start is None or _start_time(pid) == start)


class WorkerProcess:
    """One worker process: `wait()` returns once it has ended (its exit status for a child we
    started, None for an adopted one); `signal()` never reaches another process."""

    def __init__(self, pid: int, popen: subprocess.Popen[bytes] | None = None) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.ended = False
        self._popen = popen
        self._start = _start_time(pid)
        try:
            self._pidfd = os.pidfd_open(pid)
        except OSError:  # no pidfd (an old kernel, some sandboxes): poll /proc instead
            self._pidfd = -1

    @property
    def adopted(self) -> bool:
        return self._popen is None

    async def wait(self) -> int | None:
        """Until the process ends; its exit status (negative: the signal), or None when it is
        not our child."""
        if not self.ended:
            if self._pidfd >= 0:
                loop = asyncio.get_running_loop()
                done: asyncio.Future[None] = loop.create_future()
                loop.add_reader(self._pidfd, lambda: done.done() or done.set_result(None))
                try:
                    await done
                finally:
                    loop.remove_reader(self._pidfd)
            elif self._popen is not None:
                await asyncio.to_thread(self._popen.wait)
            else:
                while _alive(self.pid, self._start):
                    await asyncio.sleep(POLL_INTERVAL)
            self.ended = True
            if self._popen is not None:
                # It has ended: reaping it does not block.
                self.returncode = self._popen.wait()
            self._close()
        return self.returncode

    def signal(self, sig: int) -> None:
        """Send `sig` if the process has not ended (a no-op afterwards)."""
        if self.ended:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if self._pidfd >= 0:
                try:
                    signal.pidfd_send_signal(self._pidfd, sig)
                    return
                except OSError as exc:  # a kernel or sandbox with pidfds but not this call
                    if isinstance(exc, ProcessLookupError | PermissionError):
                        raise
            if _alive(self.pid, self._start):
                os.kill(self.pid, sig)

    def _close(self) -> None:
        if self._pidfd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._pidfd)
            self._pidfd = -1

    def forget(self) -> None:
        """This gpupoold is leaving the process running (its lease continues without us): drop
        what we hold of it, never signal it."""
        self.ended = True
        self._close()
        if self._popen is not None:
            # The Popen object must not reap or warn about a process left running on purpose.
            self._popen.returncode = 0
