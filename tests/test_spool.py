"""The record spool (gpupoold/store/spool.py) and the store's use of it (store/database.py).

The format: records appended are read back in order, a torn last record (a crash mid-write) is
skipped with a warning and cut off before the next append, a damaged record elsewhere is
skipped, and a spool of another format is refused, not guessed at. The store: records made
while the database is unreachable wait in the spool on disk, survive the daemon's stop, and are
written once, in order, at the next start; a replay that runs twice writes each record once.
The store tests run on SQLite and on a real PostgreSQL (test_store.py's `location`). The
end-to-end test (a daemon SIGKILLed during a PostgreSQL outage) is in
tests/test_e2e_spool.py."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import stat
import time
from pathlib import Path
from typing import Any

import pytest
from test_store import db, db_path, location, new_lease  # noqa: F401  (fixtures)

from gpupoold.pool.usage import LeaseUsage, MinuteUsage, UsageDelta
from gpupoold.store import replay
from gpupoold.store.database import Store, StoreDB
from gpupoold.store.replay import SPOOLED_CALLS
from gpupoold.store.spool import HEADER, SPOOL_NAME, Spool, SpooledRecord, SpoolError
from gpupoold.store.usage import usage_to_json


def record(n: int) -> SpooledRecord:
    return SpooledRecord.new("audit", ["api:root", "gpu.drain", f"gpu {n}", "why\nnot", 12.5 + n],
                             {})


def read_all(path: Path) -> list[SpooledRecord]:
    spool = Spool(path)
    spool.open()
    return [r for r, _ in spool.read().records]


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / SPOOL_NAME


def test_records_are_read_back_in_order_from_a_private_file(path: Path) -> None:
    spool = Spool(path)
    assert spool.open() == 0 and not path.exists() and spool.read().records == []
    made = [record(n) for n in range(3)]
    for r in made:
        spool.append(r)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # lease records say who used the GPUs
    assert path.read_bytes().startswith(HEADER) and spool.size == path.stat().st_size
    assert read_all(path) == made  # a new reader (the next start) finds them all
    got = spool.read()
    assert [r for r, _ in got.records] == made and got.end == spool.size
    # Reading from a record's end offset gives the records after it.
    assert [r for r, _ in spool.read(got.records[0][1]).records] == made[1:]
    spool.remove()
    assert not path.exists() and spool.size == 0 and read_all(path) == []


def test_a_torn_last_record_is_skipped_with_a_warning_and_cut_off_before_the_next_append(
        path: Path, caplog: pytest.LogCaptureFixture) -> None:
    spool = Spool(path)
    first, second, torn, after = (record(n) for n in range(4))
    spool.append(first)
    spool.append(second)
    with path.open("ab") as f:  # the crash: half of a line, no newline
        f.write(torn.line()[:30])
    again = Spool(path)
    with caplog.at_level(logging.WARNING, "gpupoold.store"):
        assert again.open() == 2
    assert "ends with a torn record (30 bytes" in caplog.text
    again.append(after)  # starts a line of its own: the torn bytes are gone
    assert read_all(path) == [first, second, after]


def test_a_damaged_record_is_skipped_and_the_others_are_read(
        path: Path, caplog: pytest.LogCaptureFixture) -> None:
    spool = Spool(path)
    made = [record(n) for n in range(3)]
    for r in made:
        spool.append(r)
    data = bytearray(path.read_bytes())
    at = data.index(b"gpu 1")
    data[at + 4] = ord("7")  # one byte of the middle record's JSON: its checksum fails
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, "gpupoold.store"):
        again = Spool(path)
        assert again.open() == 2
        got = again.read()
    assert [r for r, _ in got.records] == [made[0], made[2]] and got.skipped == 1
    assert "damaged record at byte" in caplog.text


def test_a_spool_of_another_version_is_refused_and_left_alone(path: Path) -> None:
    content = b"gpupool-spool 2\nsomething newer\n"
    path.write_bytes(content)
    with pytest.raises(SpoolError, match=r"not a record spool this gpupoold can read.*"
                                         r"start the gpupoold that wrote it"):
        Spool(path).open()
    assert path.read_bytes() == content


def test_a_spool_torn_while_being_created_held_nothing(path: Path) -> None:
    path.write_bytes(HEADER[:7])
    spool = Spool(path)
    assert spool.open() == 0 and not path.exists()
    spool.append(record(1))
    assert len(read_all(path)) == 1


def test_record_values_survive_the_round_trip(path: Path) -> None:
    r = SpooledRecord.new("lease_ended", [7, 1.0 / 3, "client exit", "d\u00e9tail", 1 << 62, 0,
                                          {"copy": 3}], {"module_bytes": 5})
    spool = Spool(path)
    spool.append(r)
    (back,) = read_all(path)
    assert back == r and back.args[1] == 1.0 / 3 and len(r.id) == 32


# ------------------------------------------------------------------------------ the store
def database_away(store: Store, monkeypatch: pytest.MonkeyPatch) -> dict[str, bool]:
    """Make the store's record calls fail as with an unreachable database until the switch's
    "away" is False (its queries still work: the test reads through them)."""
    switch = {"away": True}
    for name in SPOOLED_CALLS:
        real = getattr(store._db, name)

        def call(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
            if switch["away"]:
                raise sqlite3.OperationalError("unable to open database file")
            return _real(*args, **kwargs)

        call.__name__ = name
        monkeypatch.setattr(store._db, name, call)
    return switch


async def make_outage_records(store: Store, lease_id: int) -> None:
    """One record of each kind, in this order."""
    await store.lease_event(lease_id, 1.0, "detached", 0, "idle", 1, 0.0)
    await store.record_usage(UsageDelta(minutes=[MinuteUsage(0, 60.0, "alice", 30.0, 15.0)],
                                        leases={lease_id: LeaseUsage(30.0, 15.0)}))
    await store.lease_event(lease_id, 2.0, "attached", gpu_index=0, detail="back", detaches=1,
                            detached_s=1.0)
    await store.lease_ended(lease_id, 5.0, "client exit", "", 1, 2, {"copy": 1})
    await store.lease_scrubbed(lease_id, True, {"ok": True})
    await store.audit("api:root", "gpu.drain", "gpu 0", "during the outage")


async def check_written_once(store: Store, lease_id: int) -> None:
    lease = await store.get_lease(lease_id)
    assert lease is not None
    assert (lease.ended, lease.end_reason, lease.calls, lease.scrub_ok) == (
        5.0, "client exit", {"copy": 1}, True)
    assert (lease.detaches, lease.detached_s, lease.leased_s, lease.busy_s) == (1, 1.0, 30.0, 15.0)
    events = await store.lease_events(lease_id)
    assert [(e["at"], e["state"]) for e in events] == [(1.0, "detached"), (2.0, "attached")]
    minutes = await store.usage_minutes(0.0, 120.0)
    assert [(m["leased_s"], m["busy_s"]) for m in minutes] == [(30.0, 15.0)]
    assert [a.detail for a in await store.audit_log(10)] == ["during the outage"]


async def test_records_of_an_outage_wait_on_disk_and_are_written_once_at_the_next_start(
        location: Path | str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
        caplog: pytest.LogCaptureFixture) -> None:
    """The database away, records go to the spool (fsync'd: the daemon may be killed any
    time); gpupoold stops with them there; a first replay committed two of them and was
    killed before it removed the spool; the next start writes the rest, each record once."""
    monkeypatch.setattr(replay, "PENDING_RETRY_S", 30.0)  # no retry within the test
    state = tmp_path / "state"
    state.mkdir()
    spool = state / SPOOL_NAME
    store = await Store.open(location, server="a", state_dir=state)
    lease_id = await store.lease_started(new_lease())
    database_away(store, monkeypatch)
    with caplog.at_level(logging.ERROR, "gpupoold.store"):
        await make_outage_records(store, lease_id)
    assert caplog.text.count("the store cannot be reached") == 1  # the outage, logged once
    assert store.pending == 6 and store.spool_bytes == spool.stat().st_size > 0
    await store.close()  # stopped during the outage: the records stay on disk
    spooled = Spool(spool)
    assert spooled.open() == 6
    calls = [r.call for r, _ in spooled.read().records]
    assert calls == ["lease_event", "record_usage", "lease_event", "lease_ended",
                     "lease_scrubbed", "audit"]
    # The previous run's replay had committed the first two when it was killed.
    previous = StoreDB(location, server="a")
    try:
        assert [previous.apply_spooled(r)
                for r, _ in spooled.read().records[:2]] == [True, True]
    finally:
        previous.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, "gpupoold.store"):
        store = await Store.open(location, server="a", state_dir=state)
    try:
        assert "4 record(s) written from the spool" in caplog.text
        assert "(2 it had already, 0 refused, 0 damaged), spool removed" in caplog.text
        assert not spool.exists() and store.pending == 0 and store.spool_bytes == 0
        await check_written_once(store, lease_id)
    finally:
        await store.close()


def test_a_spooled_record_applied_twice_is_written_once(db: StoreDB) -> None:  # noqa: F811
    lease_id = db.lease_started(new_lease())
    delta = UsageDelta(minutes=[MinuteUsage(0, 60.0, "alice", 30.0, 15.0)],
                       leases={lease_id: LeaseUsage(30.0, 15.0)})
    records = [SpooledRecord.new("lease_event", [lease_id, 1.0, "detached", 0, "idle", 1, 0.0],
                                 {}),
               SpooledRecord.new("record_usage", [usage_to_json(delta)], {}),
               SpooledRecord.new("audit", ["api:root", "gpu.drain", "gpu 0", "x", 3.0], {})]
    assert [db.apply_spooled(r) for r in records] == [True, True, True]
    assert [db.apply_spooled(r) for r in records] == [False, False, False]
    assert len(db.lease_events(lease_id)) == 1 and len(db.audit_log()) == 1
    assert [m["leased_s"] for m in db.usage_minutes(0.0, 120.0)] == [30.0]
    db.forget_spooled([r.id for r in records])  # the spool is gone: the notes go too
    assert db._conn.execute("SELECT COUNT(*) FROM spool_applied").fetchone()[0] == 0


async def test_records_made_while_the_spool_is_written_follow_it_in_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The database back, the spool is written by the retry loop while new records arrive:
    they go after the spooled ones, and the spool is removed once all are in."""
    monkeypatch.setattr(replay, "PENDING_RETRY_S", 0.02)
    store = await Store.open(tmp_path / "gpupoold.db", state_dir=tmp_path)
    try:
        lease_id = await store.lease_started(new_lease())
        switch = database_away(store, monkeypatch)
        for n in range(20):
            await store.lease_event(lease_id, float(n), "detached", 0, str(n), n, 0.0)
        switch["away"] = False
        n = 20
        while store.pending and n < 60:  # the spool is being written: these join it
            await store.lease_event(lease_id, float(n), "attached", 0, str(n), n, 0.0)
            n += 1
        deadline = time.monotonic() + 30
        while store.pending and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert n > 20 and store.pending == 0 and not (tmp_path / SPOOL_NAME).exists()
        events = await store.lease_events(lease_id)
        assert [e["detail"] for e in events] == [str(i) for i in range(n)]
    finally:
        await store.close()


async def test_a_record_the_database_refuses_is_logged_not_spooled(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = await Store.open(tmp_path / "gpupoold.db", state_dir=tmp_path)
    try:
        with caplog.at_level(logging.ERROR, "gpupoold.store"):
            await store.lease_ended(999, 1.0, "client exit", "", 0, 0, {})
        assert "refused the record lease_ended(999, 1.0): no lease 999" in caplog.text
        assert store.pending == 0 and not (tmp_path / SPOOL_NAME).exists()
    finally:
        await store.close()


async def test_a_postgresql_store_needs_a_folder_for_its_spool() -> None:
    with pytest.raises(ValueError, match="needs a state directory for its record spool"):
        await Store.open("postgresql://gpupool@127.0.0.1:1/x")


async def test_a_record_no_replay_can_write_is_dropped_and_the_rest_written(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A spool left with a record of a call this gpupoold does not know, one for a lease the
    database does not have, and a damaged line: each is logged and skipped, never retried
    forever; the record after them is written and the spool removed."""
    sync = StoreDB(tmp_path / "gpupoold.db")
    try:
        lease_id = sync.lease_started(new_lease())
    finally:
        sync.close()
    spool = Spool(tmp_path / SPOOL_NAME)
    spool.append(SpooledRecord.new("lease_teleported", [lease_id], {}))
    spool.append(SpooledRecord.new("lease_ended", [lease_id + 1, 4.0, "client exit", "", 0, 0,
                                                   {}], {}))
    spool.append(SpooledRecord.new("audit", ["a", "damaged", "", "", 1.0], {}))
    spool.append(SpooledRecord.new("lease_ended", [lease_id, 5.0, "client exit", "", 0, 0, {}],
                                   {}))
    data = spool.path.read_bytes()
    spool.path.write_bytes(data.replace(b'"damaged"', b'"DAMAGED"'))
    with caplog.at_level(logging.WARNING, "gpupoold.store"):
        store = await Store.open(tmp_path / "gpupoold.db")
    try:
        assert "unknown call 'lease_teleported'" in caplog.text
        assert f"no lease {lease_id + 1}" in caplog.text
        assert "1 record(s) written from the spool" in caplog.text
        assert "(0 it had already, 2 refused, 1 damaged), spool removed" in caplog.text
        assert not spool.path.exists()
        lease = await store.get_lease(lease_id)
        assert lease is not None and lease.ended == 5.0
        assert await store.audit_log(10) == []
    finally:
        await store.close()
