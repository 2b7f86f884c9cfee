"""The servers sharing one store (PostgreSQL, `database`): each registers at start, writes a
heartbeat every HEARTBEAT_S, and checks the others; one silent for DOWN_AFTER_S is marked down
and its open leases are ended in the history ("server down"), by whichever live server sees it
first (the store makes that a single transition). A clean stop marks this server down itself,
its leases left open for its next start to take over (docs/architecture.md, "Reliability").
With SQLite the one server registers too (the API then lists one server) but sends no
heartbeats: nobody else reads that database, and each would be a synced write every 2 s.

Heartbeats, the judgement of silence and the times of a mark down are the database's clock
(store.clock()), not this server's: a server whose wall clock jumps ahead would otherwise see
every other one silent and end their leases, and one whose clock jumps back would look silent to
all the others. The wait below is this server's monotonic clock.

While the store is unreachable nobody can heartbeat; once it is back, a server waits until the
others have had the time to heartbeat again before it judges them, so an outage of the database
does not mark the whole fleet down. The fleet queue and redirects are pool/fleet.py's.

A server registers what the others need to reach it safely (store.ServerRegistration): the
fingerprint of its remoting TLS identity (a redirect's `redirect_fingerprint`, the info reply's
`fleet_servers`), the HTTP address the others must use (`http_advertise`, never a wildcard), its
scheme and the fingerprint of its HTTPS certificate (http/fleet_actions.py forwards with it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time

from gpupoold.store.database import ServerRegistration, Store, store_errors
from gpupoold.tasks import stop_task

log = logging.getLogger("gpupoold.membership")

HEARTBEAT_S = 2.0
DOWN_AFTER_S = 10.0 - 2 * HEARTBEAT_S  # seen down within 10 s of its last heartbeat


class Membership:
    def __init__(self, store: Store, remoting: str, http: str,
                 reg: ServerRegistration | None = None) -> None:
        self.store = store
        self.remoting = remoting
        self.http = http  # the address the HTTP listener is bound to
        self.reg = reg or ServerRegistration()
        self._task: asyncio.Task[None] | None = None
        self._judge_after = 0.0  # time.monotonic() before which no other server is marked down

    @property
    def name(self) -> str:
        return self.store.server

    async def start(self) -> None:
        await self.store.server_up(self.remoting, self.http, await self.store.clock(), self.reg)
        if self.store.path is None:  # a shared store (see the top)
            self._task = asyncio.create_task(self._run(), name="membership")

    async def set_http(self, address: str, advertised: str = "", scheme: str = "",
                       fingerprint: str = "") -> None:
        """The HTTP listener, once it is bound (after start: the application's start-up runs
        before the HTTP site listens): its bound `address`, the `advertised` one the others
        must use, its `scheme` and its HTTPS certificate's `fingerprint`; written at once."""
        reg = dataclasses.replace(self.reg, http_address=advertised, http_scheme=scheme,
                                  http_fingerprint=fingerprint)
        if address != self.http or reg != self.reg:
            self.http, self.reg = address, reg
            with contextlib.suppress(*store_errors()):
                await self.store.server_up(self.remoting, self.http, await self.store.clock(),
                                           self.reg)

    async def _run(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                await self.beat()
            except store_errors() as exc:  # the database may come back: keep trying
                if not failing:
                    log.warning("membership: cannot reach the store (%s); heartbeats resume "
                                "when it is back", str(exc).strip() or type(exc).__name__)
                failing = True
                # Nobody could heartbeat meanwhile: judge the others only once they have had
                # the time to, after the store is back.
                self._judge_after = time.monotonic() + DOWN_AFTER_S + HEARTBEAT_S
                continue
            except Exception:  # noqa: BLE001 - a bug must not end the heartbeats
                log.exception("membership: heartbeat failed")
                continue
            if failing:
                log.warning("membership: the store is reachable again")
            failing = False

    async def beat(self) -> None:
        """One heartbeat and one look at the others, on the database's clock."""
        now = await self.store.clock()
        if not await self.store.server_heartbeat(now):
            log.warning("this server (%s) was marked down by another while silent; its leases "
                        "were ended in the history; registering again", self.name)
            await self.store.server_up(self.remoting, self.http, now, self.reg)
        if time.monotonic() < self._judge_after:
            return
        for name in await self.store.silent_servers(now - DOWN_AFTER_S):
            ended = await self.store.server_down(
                name, now, f"no heartbeat for {DOWN_AFTER_S:.0f} s (seen by {self.name})")
            if ended is not None:
                log.warning("server %s stopped sending heartbeats: marked down, %d of its leases "
                            "ended in the history", name, ended)

    async def close(self) -> None:
        await stop_task(self._task)
        self._task = None
        with contextlib.suppress(Exception):  # leases stay open: a restart takes them over
            await self.store.server_down(self.name, await self.store.clock(), "stopped",
                                         end_leases=False)
