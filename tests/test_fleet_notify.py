"""A fleet sync NOTIFYs only the servers it concerns (store/fleet.py, store/notify.py; issue 34,
item 1): bench/fleet_scale.py showed that a NOTIFY for every server made each grant and each
lease's end cost a locked sync of every server. Here, on a real PostgreSQL: the server holding a
GPU for another's waiter is told, the others are not; a waiter served by its own server's GPU
tells nobody; and each server's listener acts only on a notification that names it (or none)."""

from __future__ import annotations

import time
from typing import Any

import psycopg
from test_fleet import gpu, waiter

from gpupoold.pool.fleet import match
from gpupoold.store.database import StoreDB
from gpupoold.store.fleet import CHANNEL, GpuRow, QueueRow, SyncInput, SyncResult
from gpupoold.store.notify import Notifications


def test_a_sync_notifies_the_servers_it_concerns_and_no_other(pg_url: str) -> None:
    dbs = {name: StoreDB(pg_url, server=name) for name in ("a", "b", "c")}
    listener = psycopg.connect(pg_url, autocommit=True)
    try:
        for db in dbs.values():
            db.server_up("127.0.0.1:1", "127.0.0.1:2", time.time())
        listener.execute(f"LISTEN {CHANNEL}")

        def sync(name: str, gpus: list[GpuRow],
                 waiters: list[tuple[int, QueueRow]] | None = None) -> SyncResult:
            return dbs[name].fleet_sync(SyncInput(name, gpus, waiters or []),
                                        lambda g, q, up, away: match(g, q, up, 0, away))

        def told() -> list[str]:
            return [n.payload for n in listener.notifies(timeout=0.3, stop_after=10)]

        sync("b", [gpu("b", free=False)])
        sync("c", [gpu("c")])
        told()  # (whatever the set-up said)
        # a's waiter, a's own GPU busy: it gets c's GPU. c holds it for the client: c is told;
        # b, which neither gave nor got anything, is not.
        res = sync("a", [gpu("a", free=False)], [(1, waiter(0, "a", token="t"))])
        assert [(s, i) for _t, s, i in res.assigned] == [("c", 0)]
        assert told() == ["c"]
        # A waiter on b served by b's own GPU (now free): nobody else needs to know.
        res = sync("b", [gpu("b")], [(2, waiter(0, "b", token="u"))])
        assert [(s, i) for _t, s, i in res.assigned] == [("b", 0)]
        assert told() == []
        # A new waiter nobody can serve (every GPU busy or held): no notification either.
        res = sync("a", [gpu("a", free=False)], [(3, waiter(0, "a", token="v"))])
        assert res.assigned == [] and told() == []
    finally:
        listener.close()
        for db in dbs.values():
            db.close()


def test_a_server_acts_on_a_notification_that_names_it_or_none() -> None:
    def listening(server: str) -> Any:
        return Notifications("postgresql://unused", None, lambda: None, server=server)

    b = listening("b")
    assert b.concerns("a b") and b.concerns("b") and b.concerns("")
    assert not b.concerns("a c") and not b.concerns("bb")
    assert listening("").concerns("a")  # a listener for no server in particular: every one
