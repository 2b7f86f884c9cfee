"""A PostgreSQL failover under a running gpupoold (issue 34, item 7): two PostgreSQL instances
on this machine, a primary and its streaming standby (tests/pg_server.py: pg_basebackup -R),
and gpupoold on the multi-host URL `postgresql://h1:p1,h2:p2/db?target_session_attrs=read-write`
that docs/operator-guide.md ("Large fleets") tells operators to write. A lease runs; the primary
crashes (`pg_ctl stop -m immediate`: no shutdown checkpoint, as a dead host leaves it); the lease
ends while there is no primary (its record goes to the record spool); the standby is promoted.
gpupoold finds the new primary by itself, through libpq's host list, and replays the spool
there: the lease's end is recorded once, with the reason it really had, and a new client is
granted afterwards.

The bound on finding the new primary is 30 s (the spool is retried every second and a
connection attempt to a refusing host fails at once); it is a generous bound, not a target."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import require, wait_until
from test_e2e_leases import hold_gpu, start_client  # noqa: F401  (hold_gpu is a fixture)

from gpupoold.store.database import StoreDB
from gpupoold.store.spool import SPOOL_NAME, peek

MIB = 1 << 20
RECONNECT_BOUND_S = 30


@pytest.fixture
def primary_and_standby() -> Iterator[tuple[Any, Any]]:
    """A primary with a database `gpupool` and its streaming standby (this test stops the
    primary, so it cannot be the session's PostgreSQL)."""
    import pg_server as pgs

    require(not (why := pgs.available()), why)
    require(pgs._bin("pg_basebackup"), "pg_basebackup not found: apt-get install postgresql")
    primary = pgs.PgServer()
    standby = None
    try:
        import psycopg

        with psycopg.connect(primary.url(), autocommit=True) as conn:
            conn.execute('CREATE DATABASE "gpupool"')
        standby = pgs.PgServer(primary)
        yield primary, standby
    finally:
        if standby is not None:
            standby.close()
        primary.close()


def test_failover_to_a_promoted_standby_loses_no_record_and_grants_again(
        start_daemon: Any, native_build: Path, hold_gpu: Path,  # noqa: F811
        primary_and_standby: tuple[Any, Any], clients: list[subprocess.Popen[str]]) -> None:
    primary, standby = primary_and_standby
    url = (f"postgresql://gpupool@127.0.0.1:{primary.port},127.0.0.1:{standby.port}/gpupool"
           "?target_session_attrs=read-write")
    server = start_daemon("--database", url, simulated=2, build_dir=native_build)
    holder = start_client(server, hold_gpu, MIB, 4000, 1)  # outlives the primary
    clients.append(holder)
    wait_until("the lease", lambda: len(
        server.get_json("/api/v1/leases?state=active")["leases"]) == 1, timeout=30)

    primary.stop("immediate")  # the primary's host dies
    _, err = holder.communicate(timeout=60)  # the lease goes on, and ends, without a primary
    assert holder.returncode == 0, err
    spool = server.state_dir / SPOOL_NAME
    wait_until("the lease's end in the spool", lambda: any(
        r.call == "lease_ended" for r in peek(spool)), timeout=30)

    standby.promote()  # what Patroni (or the operator) does
    server.wait_for_log(r"the store is reachable again: \d+ record\(s\) written from the spool",
                        timeout=RECONNECT_BOUND_S)
    assert not spool.exists()

    after = start_client(server, hold_gpu, MIB, 100, 2)  # granted by the new primary's store
    clients.append(after)
    _, err = after.communicate(timeout=60)
    assert after.returncode == 0, err

    db = StoreDB(standby.url("gpupool"))  # the new primary has the whole history
    try:
        history = db.leases("all", 100)
    finally:
        db.close()
    by_pid = {pid: [r for r in history if r.client_pid == pid]
              for pid in (holder.pid, after.pid)}
    assert [len(rows) for rows in by_pid.values()] == [1, 1], history  # each lease once
    (ended,) = by_pid[holder.pid]
    assert ended.end_reason == "client exit" and ended.ended is not None, ended
    assert ended.scrub_ok is not None, ended  # its GPU's scrub, made without a primary, too
