"""LISTEN for the fleet's NOTIFYs (store/fleet.py's CHANNEL) on a connection of its own.

psycopg delivers notifications to the connection that listens, and the store's connection is busy
with queries on the store's thread; so one more connection, on a thread of its own, waits for them
and calls `on_notify` on the event loop, for a notification that names this server (`server`) or
no server in particular (store/fleet.py's CHANNEL: its payload names the servers concerned). A
server that misses notifications (the database restarted, the connection dropped) only reacts
later: the fleet queue syncs every second anyway (pool/fleet.py), and this thread reconnects.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from pathlib import Path

from gpupoold.store import postgres
from gpupoold.store.fleet import CHANNEL

log = logging.getLogger("gpupoold.store")

WAIT_S = 0.5  # how often the thread looks whether it should stop
RETRY_S = 1.0  # between connection attempts while the database is unreachable


class Notifications:
    def __init__(self, url: str, password_file: Path | None,
                 on_notify: Callable[[], None], server: str = "") -> None:
        self._url = url
        self._server = server  # "": every notification concerns it
        self._password_file = password_file
        self._on_notify = on_notify
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.received = 0

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._main, name="gpupoold-notify", daemon=True)
        self._thread.start()

    async def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5.0)

    def concerns(self, payload: str) -> bool:
        """Whether a notification with this payload is for this server."""
        return not payload or not self._server or self._server in payload.split()

    def _main(self) -> None:
        failed = False
        while not self._stop.is_set():
            try:
                conn = postgres.PgConnection(self._url, self._password_file)
            except Exception as exc:  # noqa: BLE001 - unreachable: try again
                if not failed:
                    log.warning("fleet notifications: cannot connect (%s); retrying", exc)
                failed = True
                self._stop.wait(RETRY_S)
                continue
            failed = False
            try:
                conn.execute(f"LISTEN {CHANNEL}")
                raw = conn.raw
                while not self._stop.is_set():
                    got = sum(1 for n in raw.notifies(timeout=WAIT_S, stop_after=64)
                              if self.concerns(n.payload))
                    if got:
                        self.received += got
                        assert self._loop is not None
                        self._loop.call_soon_threadsafe(self._on_notify)
            except Exception as exc:  # noqa: BLE001 - the connection dropped: a new one
                if not self._stop.is_set():
                    log.warning("fleet notifications: connection lost (%s); reconnecting", exc)
                    self._stop.wait(RETRY_S)
            finally:
                try:
                    conn.close()
                except Exception:  # noqa: BLE001 - closing a broken connection
                    pass
