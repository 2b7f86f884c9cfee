"""systemd's notification protocol (sd_notify(3)) without libsystemd.

Under `Type=notify` systemd sets $NOTIFY_SOCKET: an AF_UNIX datagram socket, a path or, when it
starts with '@', a name in the abstract namespace. gpupoold sends `READY=1` once both listeners
are up, `STOPPING=1` when it begins to shut down, and, when the unit has `WatchdogSec=` (systemd
then sets $WATCHDOG_USEC, and $WATCHDOG_PID to the pid it watches), `WATCHDOG=1` every half of
that interval from an asyncio task: an event loop that stops turning stops feeding the watchdog,
and systemd restarts the daemon. Without $NOTIFY_SOCKET everything here does nothing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Mapping
from contextlib import suppress

log = logging.getLogger("gpupoold")


def _address(value: str) -> str | bytes | None:
    """The socket address of a $NOTIFY_SOCKET value; None when it is not one we can use."""
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    return None  # e.g. vsock:... (VMs): not for a daemon on a host


def watchdog_interval(env: Mapping[str, str] | None = None, pid: int | None = None,
                      ) -> float | None:
    """Seconds between WATCHDOG=1 pings (half of $WATCHDOG_USEC), or None when systemd did not
    ask this process for them ($WATCHDOG_USEC unset or invalid, $WATCHDOG_PID another pid)."""
    env = os.environ if env is None else env
    pid = os.getpid() if pid is None else pid
    usec = env.get("WATCHDOG_USEC", "")
    watched = env.get("WATCHDOG_PID", "")
    if watched and watched != str(pid):
        return None
    try:
        value = int(usec)
    except ValueError:
        return None
    if value <= 0:
        return None
    return value / 2 / 1e6


class Notifier:
    """Sends notifications to $NOTIFY_SOCKET (read when made). Never raises: a notification that
    cannot be sent is logged once and the daemon goes on."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        raw = env.get("NOTIFY_SOCKET", "")
        self.address = _address(raw) if raw else None
        if raw and self.address is None:
            log.warning("NOTIFY_SOCKET=%s is not a Unix socket path or @abstract name: systemd "
                        "will not hear that gpupoold is ready (use Type=simple, or run it under "
                        "systemd's own NOTIFY_SOCKET)", raw)
        self.watchdog = watchdog_interval(env) if self.address is not None else None
        self._sock: socket.socket | None = None
        self._failed = False
        self._task: asyncio.Task[None] | None = None

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *fields: str) -> bool:
        """Send `KEY=value` fields in one datagram; True when it went out."""
        if self.address is None:
            return False
        message = "\n".join(fields).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(message, self.address)
        except OSError as exc:
            if not self._failed:
                self._failed = True
                log.warning("cannot notify systemd (NOTIFY_SOCKET): %s; if the unit is "
                            "Type=notify, systemd will time the start out or the watchdog will "
                            "restart gpupoold", exc.strerror or exc)
            return False
        return True

    def ready(self, status: str) -> None:
        """READY=1 with a STATUS= line; starts the watchdog task when one was asked for."""
        if not self.enabled:
            return
        self.send("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")
        if self.watchdog is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._feed(self.watchdog),
                                                                name="sd-watchdog")

    def stopping(self, status: str = "stopping") -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self.send("STOPPING=1", f"STATUS={status}")

    async def _feed(self, interval: float) -> None:
        while True:
            self.send("WATCHDOG=1")
            await asyncio.sleep(interval)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self._sock is not None:
            with suppress(OSError):
                self._sock.close()
            self._sock = None
