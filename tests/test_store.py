"""The store (gpupoold/store/database.py): schema and migrations, records, and the daemon's async
store sharing the database with the CLI's synchronous access. Every test of the records runs on
SQLite and on a real PostgreSQL (`location`); SQLite's own behaviour (WAL, its file, its locks)
and PostgreSQL's own (URLs, passwords, servers sharing one database) have tests of their own."""

from __future__ import annotations

import asyncio
import json
import socket
import sqlite3
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from gpupoold.store import database as store_mod
from gpupoold.store.database import (
    SCHEMA_VERSION,
    NewLease,
    NotFound,
    SchemaTooNew,
    Store,
    StoreClosed,
    StoreDB,
    TokenExists,
)
from gpupoold.store.postgres import UrlError
from gpupoold.store.records import LeaseFilter


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "gpupoold.db"


@pytest.fixture(params=["sqlite", "postgresql"])
def location(request: pytest.FixtureRequest, db_path: Path) -> Path | str:
    """Where a store lives: a SQLite file, or a fresh PostgreSQL database's URL."""
    return db_path if request.param == "sqlite" else request.getfixturevalue("pg_url")


@pytest.fixture
def db(location: Path | str) -> Iterator[StoreDB]:
    d = StoreDB(location)
    yield d
    d.close()


@pytest.fixture
async def store(location: Path | str, tmp_path: Path) -> AsyncIterator[Store]:
    s = await Store.open(location, state_dir=tmp_path)
    yield s
    await s.close()


@pytest.fixture
def sqlite_db(db_path: Path) -> Iterator[StoreDB]:
    d = StoreDB(db_path)
    yield d
    d.close()


@pytest.fixture
async def sqlite_store(db_path: Path) -> AsyncIterator[Store]:
    s = await Store.open(db_path)
    yield s
    await s.close()


def new_lease(gpu: int = 0, token: str = "alice", pid: int = 100) -> NewLease:
    return NewLease(gpu_index=gpu, gpu_uuid=f"GPU-{gpu:04d}", gpu_name="H100 (simulated)",
                    simulated=True, token_name=token, client_host="laptop", client_user="ada",
                    client_pid=pid, program="train.py", peer="10.0.0.5:5000",
                    request="any GPU", queued_s=1.5, started=time.time())


def raw(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None)


# ----------------------------------------------------------------------- schema, migrations
def test_a_new_database_gets_the_current_schema_in_wal_mode(sqlite_db: StoreDB, db_path: Path) -> None:
    assert sqlite_db.schema_version() == SCHEMA_VERSION == 17
    conn = raw(db_path)
    try:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        assert {"tokens", "leases", "audit", "gpu_state", "lease_events", "servers", "fleet_gpus",
                "fleet_queue", "fleet_away", "spool_applied"} <= tables
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        cols = {r[1] for r in conn.execute("PRAGMA table_info(tokens)")}
        assert cols == {"id", "name", "role", "secret_sha256", "created", "expires", "revoked",
                        "last_used", "created_by", "weight"}
    finally:
        conn.close()
    assert db_path.stat().st_mode & 0o777 == 0o600


def test_reopening_keeps_the_records(location: Path | str) -> None:
    first = StoreDB(location)
    first.create_token("alice", "user", None, "test")
    lease_id = first.lease_started(new_lease())
    first.close()
    again = StoreDB(location)
    try:
        assert again.schema_version() == SCHEMA_VERSION
        assert [t.name for t in again.list_tokens()] == ["alice"]
        assert again.get_lease(lease_id) is not None
    finally:
        again.close()


def test_a_newer_schema_is_refused(db_path: Path) -> None:
    StoreDB(db_path).close()
    conn = raw(db_path)
    conn.execute("PRAGMA user_version = 99")
    conn.close()
    with pytest.raises(SchemaTooNew, match="version 99.*upgrade gpupoold"):
        StoreDB(db_path)


def test_migrations_run_from_the_stored_version(db_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    current = StoreDB(db_path)
    current.create_token("alice", "user", None, "test")
    current.close()
    nxt = (*store_mod.MIGRATIONS,
           ("ALTER TABLE tokens ADD COLUMN note TEXT NOT NULL DEFAULT 'x'",))
    monkeypatch.setattr(store_mod, "MIGRATIONS", nxt)
    monkeypatch.setattr(store_mod, "SCHEMA_VERSION", SCHEMA_VERSION + 1)
    db = StoreDB(db_path)  # runs only the last step: the earlier ones would fail (tables exist)
    try:
        assert db.schema_version() == SCHEMA_VERSION + 1
        assert [t.name for t in db.list_tokens()] == ["alice"]
    finally:
        db.close()
    conn = raw(db_path)
    assert conn.execute("SELECT note FROM tokens").fetchone()[0] == "x"
    conn.close()


def test_a_failed_migration_changes_nothing(db_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    StoreDB(db_path).close()
    bad = (*store_mod.MIGRATIONS, ("CREATE TABLE extra (a)", "THIS IS NOT SQL"))
    monkeypatch.setattr(store_mod, "MIGRATIONS", bad)
    monkeypatch.setattr(store_mod, "SCHEMA_VERSION", SCHEMA_VERSION + 1)
    with pytest.raises(sqlite3.OperationalError):
        StoreDB(db_path)
    monkeypatch.undo()
    db = StoreDB(db_path)
    try:
        assert db.schema_version() == SCHEMA_VERSION
    finally:
        db.close()
    conn = raw(db_path)
    assert conn.execute("SELECT count(*) FROM sqlite_master WHERE name='extra'").fetchone()[0] == 0
    conn.close()


def test_a_file_that_is_not_a_database_is_an_error(db_path: Path) -> None:
    db_path.write_bytes(b"not a database at all, just some text that is long enough" * 20)
    with pytest.raises(sqlite3.DatabaseError):
        StoreDB(db_path)


# ------------------------------------------------------------------------------------ tokens
def test_create_list_and_revoke_tokens(db: StoreDB) -> None:
    rec, text = db.create_token("alice", "user", None, "cli:root")
    assert text.startswith(f"gpt_{rec.id}_")
    assert (rec.name, rec.role, rec.expires, rec.revoked, rec.last_used, rec.created_by) == (
        "alice", "user", None, None, None, "cli:root")
    later = time.time() + 3600
    db.create_token("bob", "admin", later, "cli:root")
    assert [(t.name, t.role, t.expires) for t in db.list_tokens()] == [
        ("alice", "user", None), ("bob", "admin", later)]
    revoked = db.revoke_token("alice", "cli:root")
    assert revoked.revoked is not None and revoked.state() == "revoked"
    assert db.get_token("alice") == revoked
    assert db.get_token("nobody") is None
    actions = [(a.actor, a.action, a.target) for a in reversed(db.audit_log())]
    assert actions == [("cli:root", "token.create", "token alice"),
                       ("cli:root", "token.create", "token bob"),
                       ("cli:root", "token.revoke", "token alice")]


def test_token_json_never_holds_the_hash(db: StoreDB) -> None:
    rec, text = db.create_token("alice", "user", None, "t")
    data = rec.to_json()
    assert set(data) == {"id", "name", "role", "created", "expires", "revoked", "last_used",
                         "created_by", "state", "weight"}
    dumped = json.dumps(data)
    assert text[17:] not in dumped and "sha256" not in dumped


def test_a_tokens_share_weight_is_kept_changed_and_checked(db: StoreDB) -> None:
    """Issue 32, item 4: a token's share weight (default 1), set at creation or later, audited;
    outside 1..1000 refused (worker/pacing.c's range)."""
    assert db.create_token("alice", "user", None, "t")[0].weight == 1
    heavy, _ = db.create_token("bob", "user", None, "t", weight=3)
    assert heavy.weight == 3 and db.get_token("bob") == heavy
    assert db.set_token_weight("alice", 5, "cli:root").weight == 5
    assert [(t.name, t.weight) for t in db.list_tokens()] == [("alice", 5), ("bob", 3)]
    assert db.audit_log()[0].action == "token.weight" and "1 -> 5" in db.audit_log()[0].detail
    for bad in (0, 1001):
        with pytest.raises(ValueError, match="from 1 to 1000"):
            db.set_token_weight("alice", bad, "t")
    with pytest.raises(NotFound):
        db.set_token_weight("nobody", 2, "t")
    assert db.get_token("alice").weight == 5  # type: ignore[union-attr]


def test_token_names_are_unique_even_after_revocation(db: StoreDB) -> None:
    db.create_token("alice", "user", None, "t")
    with pytest.raises(TokenExists):
        db.create_token("alice", "admin", None, "t")
    db.revoke_token("alice", "t")
    with pytest.raises(TokenExists):
        db.create_token("alice", "user", None, "t")


def test_bad_name_or_role_is_refused(db: StoreDB) -> None:
    with pytest.raises(ValueError, match="only letters"):
        db.create_token("no spaces", "user", None, "t")
    with pytest.raises(ValueError, match="role"):
        db.create_token("alice", "root", None, "t")
    assert db.list_tokens() == []


def test_revoking_twice_keeps_the_first_time_and_audits_once(db: StoreDB) -> None:
    db.create_token("alice", "user", None, "t")
    first = db.revoke_token("alice", "t")
    second = db.revoke_token("alice", "t")
    assert second.revoked == first.revoked
    assert [a.action for a in db.audit_log()].count("token.revoke") == 1
    with pytest.raises(NotFound):
        db.revoke_token("nobody", "t")


def test_replace_token_invalidates_the_old_secret(db: StoreDB) -> None:
    old, old_text = db.replace_token("local-admin", "admin", "gpupoold")
    new, new_text = db.replace_token("local-admin", "admin", "gpupoold")
    assert old.id != new.id and old_text != new_text
    assert [t.name for t in db.list_tokens()] == ["local-admin"]
    assert db.verify_token(old_text).result == "unknown"
    assert db.verify_token(new_text).result == "ok"
    assert [a.action for a in reversed(db.audit_log())] == ["token.create", "token.rotate"]


def test_verify_results(db: StoreDB) -> None:
    _, ok = db.create_token("ok", "user", None, "t")
    _, gone = db.create_token("gone", "user", None, "t")
    db.revoke_token("gone", "t")
    _, old = db.create_token("old", "user", time.time() - 1, "t")
    assert db.verify_token(ok).result == "ok" and db.verify_token(ok).token.name == "ok"
    assert db.verify_token(f"  {ok}\n").result == "ok"  # as read from a file or variable
    assert db.verify_token("").result == "missing"
    assert db.verify_token("   ").result == "missing"
    assert db.verify_token("hunter2").result == "malformed"
    assert db.verify_token(gone).result == "revoked"
    assert db.verify_token(old).result == "expired"
    unknown = db.verify_token("gpt_000000000000_" + "A" * 43)
    assert (unknown.result, unknown.token, unknown.token_id) == ("unknown", None, "000000000000")
    # The id of a known token with another secret: unknown, and nothing about that token.
    wrong = ok[:-1] + ("B" if ok[-1] != "B" else "C")
    assert (db.verify_token(wrong).result, db.verify_token(wrong).token) == ("unknown", None)
    # Only the holder of the right secret learns that a token was revoked.
    wrong_gone = gone[:-1] + ("B" if gone[-1] != "B" else "C")
    assert db.verify_token(wrong_gone).result == "unknown"


def test_expiry_is_checked_at_verification_time(db: StoreDB) -> None:
    rec, text = db.create_token("soon", "user", 5000.0, "t")
    assert db.verify_token(text, now=4999.0).result == "ok"
    assert db.verify_token(text, now=5000.0).result == "expired"


def test_the_database_holds_no_secret(sqlite_db: StoreDB, db_path: Path) -> None:
    texts = [sqlite_db.create_token(f"user{i}", "user", None, "t")[1] for i in range(5)]
    files = [p for p in db_path.parent.iterdir() if p.name.startswith(db_path.name)]
    blob = b"".join(p.read_bytes() for p in files)
    for text in texts:
        secret = text[len("gpt_") + 13:]  # the secret itself may contain '_'
        assert len(secret) == 43
        assert secret.encode() not in blob and text.encode() not in blob
        assert store_mod.hash_secret(secret).encode() in blob  # what is stored instead


def test_touch_never_moves_last_used_back(db: StoreDB) -> None:
    rec, _ = db.create_token("alice", "user", None, "t")
    db.touch_token(rec.id, 2000.0)
    db.touch_token(rec.id, 1000.0)
    assert db.get_token("alice").last_used == 2000.0


# ------------------------------------------------------------------------------------ leases
def test_lease_life_cycle(db: StoreDB) -> None:
    lease_id = db.lease_started(new_lease(gpu=1))
    (open_rec,) = db.open_leases()
    assert open_rec.id == lease_id and open_rec.ended is None and open_rec.scrub_ok is None
    assert open_rec.simulated is True and open_rec.calls == {}
    calls = {"launch": 3, "copy": 4, "alloc": 1, "sync": 2, "other": 0}
    db.lease_ended(lease_id, 1234.5, "client lost", "connection reset", 10, 20, calls,
                   module_bytes=5000)
    scrub = {"ok": True, "problems": [], "scrub": {"bytes": 80 << 30, "duration_s": 1.5}}
    db.lease_scrubbed(lease_id, True, scrub)
    assert db.open_leases() == []
    rec = db.get_lease(lease_id)
    assert rec is not None
    assert (rec.ended, rec.end_reason, rec.end_detail, rec.bytes_h2d, rec.bytes_d2h) == (
        1234.5, "client lost", "connection reset", 10, 20)
    assert rec.calls == calls and rec.scrub_ok is True and rec.scrub == scrub
    data = json.loads(json.dumps(rec.to_json()))
    assert data["id"] == lease_id and data["gpu_index"] == 1 and data["token_name"] == "alice"
    assert data["client_pid"] == 100 and data["scrub"]["scrub"]["bytes"] == 80 << 30
    assert rec.module_bytes == 5000 and data["module_bytes"] == 5000
    assert db.get_lease(lease_id + 1) is None


def test_unscrubbed_last_leases_are_each_gpus_latest_ended_lease_without_a_scrub(
        db: StoreDB) -> None:
    calls = {"launch": 0, "copy": 0, "alloc": 0, "sync": 0, "other": 0}
    old0 = db.lease_started(new_lease(gpu=0))
    db.lease_ended(old0, 1.0, "client exit", "", 0, 0, calls)  # never scrubbed, but not latest
    last0 = db.lease_started(new_lease(gpu=0))
    db.lease_ended(last0, 2.0, "client exit", "", 0, 0, calls)  # the daemon stopped here
    last1 = db.lease_started(new_lease(gpu=1))
    db.lease_ended(last1, 3.0, "client exit", "", 0, 0, calls)
    db.lease_scrubbed(last1, True, {})  # scrubbed: nothing to do
    db.lease_started(new_lease(gpu=2))  # open: the adoption or "gone" path, not this one
    assert [r.id for r in db.unscrubbed_last_leases()] == [last0]
    db.lease_scrubbed(last0, False, {})
    assert db.unscrubbed_last_leases() == []


def test_the_gpu_filter_finds_a_lease_of_several_gpus_on_each_of_them(db: StoreDB) -> None:
    """`?gpu=N` (issue 37, item 6): a lease of GPUs 2, 0 is found by 2 (its first, gpu_index)
    and by 0 (in `gpus`), never by 1 or by 20 (a number that only contains a 2 or a 0)."""
    one = db.lease_started(new_lease(gpu=1))
    many = db.lease_started(new_lease(gpu=2))
    db.lease_gpus(many, [2, 0])
    twenty = db.lease_started(new_lease(gpu=20))

    def found(gpu: int) -> list[int]:
        return [r.id for r in db.leases(filters=LeaseFilter(gpu=gpu))]

    assert found(0) == [many] and found(2) == [many]
    assert found(1) == [one] and found(20) == [twenty] and found(3) == []
    assert db.get_lease(many).gpus == (2, 0)  # type: ignore[union-attr]


def test_lease_events_keep_every_transition_and_the_totals(db: StoreDB) -> None:
    lease_id = db.lease_started(new_lease(gpu=0))
    assert db.get_lease(lease_id).detaches == 0  # type: ignore[union-attr]
    db.lease_event(lease_id, 10.0, "detached", 0, "idle 61 s, 2 GiB saved", 1, 0.0)
    db.lease_event(lease_id, 25.5, "attached", 1, "moved from GPU 0", 1, 15.5)
    rec = db.get_lease(lease_id)
    assert rec is not None and (rec.detaches, rec.detached_s) == (1, 15.5)
    assert db.lease_events(lease_id) == [
        {"at": 10.0, "state": "detached", "gpu": 0, "gpus": [0],
         "detail": "idle 61 s, 2 GiB saved"},
        {"at": 25.5, "state": "attached", "gpu": 1, "gpus": [1], "detail": "moved from GPU 0"}]
    assert db.lease_events(lease_id + 1) == []
    with pytest.raises(NotFound):
        db.lease_event(lease_id + 1, 1.0, "detached", 0, "", 1, 0.0)


def test_a_lease_that_comes_back_after_a_detach_is_not_scrubbed_until_its_end_scrub(
        db: StoreDB) -> None:
    """The detach's scrub is recorded as the lease's scrub (its last use, unless it comes back);
    once it comes back its record says "not scrubbed" again, so that a reader waiting for the
    scrub after its end (or a restart looking for ended leases never scrubbed) is not misled."""
    lease_id = db.lease_started(new_lease(gpu=0))
    db.lease_event(lease_id, 10.0, "detached", 0, "idle", 1, 0.0)
    db.lease_scrubbed(lease_id, True, {"scrub": {"bytes": 1}})
    assert db.get_lease(lease_id).scrub_ok is True  # type: ignore[union-attr]
    db.lease_event(lease_id, 20.0, "attached", 0, "", 1, 10.0)
    rec = db.get_lease(lease_id)
    assert rec is not None and rec.scrub_ok is None and rec.scrub is None
    db.lease_ended(lease_id, 30.0, "client exit", "", 0, 0, {})
    assert [r.id for r in db.unscrubbed_last_leases()] == [lease_id]
    db.lease_scrubbed(lease_id, True, {"scrub": {"bytes": 2}})
    rec = db.get_lease(lease_id)
    assert rec is not None and rec.scrub_ok is True and rec.scrub == {"scrub": {"bytes": 2}}


def test_the_events_of_a_lease_of_several_gpus_name_every_gpu(db: StoreDB) -> None:
    """Schema v15 (issue 37): a detach names every GPU the lease left, an attach every GPU it
    came back on, in program order; "gpu" stays device 0's for older readers."""
    lease_id = db.lease_started(new_lease(gpu=2))
    db.lease_gpus(lease_id, [2, 0])
    db.lease_event(lease_id, 10.0, "detached", 2, "idle", 1, 0.0, gpus=[2, 0])
    db.lease_event(lease_id, 20.0, "attached", 3, "moved from GPU 2, 0", 1, 10.0, gpus=[3, 1])
    assert [(e["gpu"], e["gpus"]) for e in db.lease_events(lease_id)] == [(2, [2, 0]),
                                                                          (3, [3, 1])]


def test_events_written_before_v15_name_device_0s_gpu_only(db_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A lease of several GPUs whose events a v14 daemon wrote: after the upgrade its events
    read as naming one GPU (its device 0's), so readers can tell they do not know the others."""
    monkeypatch.setattr(store_mod, "MIGRATIONS", store_mod.MIGRATIONS[:14])
    monkeypatch.setattr(store_mod, "SCHEMA_VERSION", 14)
    v14 = StoreDB(db_path)
    lease_id = v14.lease_started(new_lease(gpu=0))
    v14.lease_gpus(lease_id, [0, 1])
    v14._conn.execute("INSERT INTO lease_events (lease_id, at, state, gpu_index, detail) "
                      "VALUES (?, 5.0, 'detached', 0, 'idle')", (lease_id,))
    v14.close()
    monkeypatch.undo()
    db = StoreDB(db_path)
    try:
        assert db.schema_version() == SCHEMA_VERSION  # (migrated through v15)
        db.lease_event(lease_id, 9.0, "attached", 2, "moved", 1, 4.0, gpus=[2, 3])
        assert [e["gpus"] for e in db.lease_events(lease_id)] == [[0], [2, 3]]
    finally:
        db.close()


def test_v1_lease_records_gain_module_bytes_zero(db_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Schema v2 adds leases.module_bytes; records written by a v1 daemon read 0."""
    monkeypatch.setattr(store_mod, "MIGRATIONS", store_mod.MIGRATIONS[:1])
    monkeypatch.setattr(store_mod, "SCHEMA_VERSION", 1)
    v1 = StoreDB(db_path)
    lease_id = v1.lease_started(new_lease())
    v1.close()
    monkeypatch.undo()
    db = StoreDB(db_path)
    try:
        assert db.schema_version() == SCHEMA_VERSION
        rec = db.get_lease(lease_id)
        assert rec is not None and rec.module_bytes == 0
        db.lease_ended(lease_id, 1.0, "client exit", "", 0, 0, {}, module_bytes=7)
        rec = db.get_lease(lease_id)
        assert rec is not None and rec.module_bytes == 7
    finally:
        db.close()


def test_counts_beyond_sqlite_integer_are_clamped_not_refused(db: StoreDB) -> None:
    """A worker's counts are input: one that does not fit INTEGER must not fail the record
    (that failure once left a GPU leased forever)."""
    lease_id = db.lease_started(new_lease())
    db.lease_ended(lease_id, 1.0, "client lost", "", 1 << 63, -5, {}, module_bytes=1 << 70)
    rec = db.get_lease(lease_id)
    assert rec is not None
    assert (rec.bytes_h2d, rec.bytes_d2h, rec.module_bytes) == ((1 << 63) - 1, 0, (1 << 63) - 1)


def test_unknown_lease_ids_are_not_found(db: StoreDB) -> None:
    with pytest.raises(NotFound):
        db.lease_ended(42, 1.0, "client exit", "", 0, 0, {})
    with pytest.raises(NotFound):
        db.lease_scrubbed(42, True, {})


def test_lease_listing_filters_and_pages(db: StoreDB) -> None:
    ids = [db.lease_started(new_lease(pid=i)) for i in range(7)]
    for lease_id in ids[:4]:
        db.lease_ended(lease_id, time.time(), "client exit", "", 0, 0, {})
    assert [r.id for r in db.leases("all")] == ids[::-1]
    assert [r.id for r in db.leases("active")] == ids[4:][::-1]
    assert [r.id for r in db.leases("ended")] == ids[:4][::-1]
    page1 = db.leases("all", limit=3)
    page2 = db.leases("all", limit=3, before=page1[-1].id)
    page3 = db.leases("all", limit=3, before=page2[-1].id)
    assert [r.id for r in page1 + page2 + page3] == ids[::-1]
    with pytest.raises(ValueError, match="active, ended, all"):
        db.leases("open")


def test_audit_log_pages_newest_first(db: StoreDB) -> None:
    ids = [db.audit("root", "gpu.drain", f"gpu {i}", "free") for i in range(5)]
    log = db.audit_log(limit=2)
    assert [a.id for a in log] == ids[::-1][:2]
    assert [a.id for a in db.audit_log(limit=10, before=log[-1].id)] == ids[::-1][2:]
    entry = log[0].to_json()
    assert set(entry) == {"id", "time", "actor", "action", "target", "detail", "server"}
    assert (entry["actor"], entry["action"], entry["target"], entry["detail"]) == (
        "root", "gpu.drain", "gpu 4", "free")
    assert entry["server"] == db.server  # who acted: servers sharing a store share the log


# ------------------------------------------------------------------------- the async store
async def test_async_store_round_trip(store: Store) -> None:
    rec, text = await store.create_token("alice", "admin", None, actor="api:root")
    assert (await store.verify_token(text)).token == rec
    lease_id = await store.lease_started(new_lease())
    assert [r.id for r in await store.open_leases()] == [lease_id]
    await store.lease_ended(lease_id, time.time(), "client exit", "", 1, 2, {"copy": 1})
    await store.lease_scrubbed(lease_id, False, {"ok": False, "problems": ["ecc"]})
    got = await store.get_lease(lease_id)
    assert got is not None and got.scrub_ok is False and got.calls == {"copy": 1}
    assert [r.id for r in await store.leases("ended", 10, None)] == [lease_id]
    await store.audit("api:root", "lease.end", f"lease {lease_id}", "why")
    assert [a.action for a in await store.audit_log(10)] == ["lease.end", "token.create"]
    assert (await store.revoke_token("alice", actor="api:root")).revoked is not None
    assert [t.name for t in await store.list_tokens()] == ["alice"]
    with pytest.raises(NotFound):
        await store.revoke_token("nobody", actor="x")


async def test_records_made_while_the_database_is_away_are_written_in_order_once_it_is_back(
        sqlite_store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A record (lease event) that fails with the database away is kept, with the records made
    after it, keyword arguments included, and all are written in order when it answers again."""
    import gpupoold.store.replay as replay
    monkeypatch.setattr(replay, "PENDING_RETRY_S", 0.02)
    store = sqlite_store
    lease_id = await store.lease_started(new_lease())
    real = store._db.lease_event
    away = True

    def lease_event(*args: object, **kwargs: object) -> None:
        if away:
            raise sqlite3.OperationalError("database is locked")
        real(*args, **kwargs)  # type: ignore[arg-type]

    lease_event.__name__ = "lease_event"
    monkeypatch.setattr(store._db, "lease_event", lease_event)
    await store.lease_event(lease_id, 1.0, "detached", 0, "first", 1, 0.0)
    await store.lease_event(lease_id, 2.0, "attached", gpu_index=1, detail="second", detaches=1,
                            detached_s=1.0)
    assert store.pending == 2 and await store.lease_events(lease_id) == []
    away = False
    for _ in range(200):
        if store.pending == 0:
            break
        await asyncio.sleep(0.01)
    events = await store.lease_events(lease_id)
    assert [(e["state"], e["gpu"], e["detail"]) for e in events] == [
        ("detached", 0, "first"), ("attached", 1, "second")]


async def test_calls_run_on_one_thread_that_is_not_the_event_loop(store: Store) -> None:
    threads = {await store._run(threading.get_ident) for _ in range(5)}
    assert len(threads) == 1 and threading.get_ident() not in threads
    if store.path is not None:
        # The connection belongs to that thread: sqlite3 itself refuses it anywhere else.
        with pytest.raises(sqlite3.ProgrammingError):
            store._db.list_tokens()


async def test_a_locked_database_does_not_block_the_event_loop(sqlite_store: Store,
                                                               db_path: Path) -> None:
    """Another process (the CLI) holding the write lock makes the store's write wait, on the
    store's thread; the loop keeps running meanwhile and the write lands when the lock goes."""
    other = raw(db_path)
    other.execute("BEGIN IMMEDIATE")
    try:
        write = asyncio.create_task(sqlite_store.audit("root", "gpu.drain", "gpu 0"))
        ticks = 0
        for _ in range(50):
            await asyncio.sleep(0)
            ticks += 1
        assert ticks == 50 and not write.done()
        other.execute("COMMIT")
        await write
    finally:
        other.close()
    assert [a.action for a in await sqlite_store.audit_log()] == ["gpu.drain"]


async def test_cli_and_daemon_write_at_the_same_time(sqlite_store: Store, db_path: Path) -> None:
    """The CLI's synchronous StoreDB (another thread here, another process in real life) and
    the daemon's Store write to one database concurrently: nothing fails, nothing is lost."""
    errors: list[BaseException] = []
    go = threading.Event()

    def cli() -> None:
        db = StoreDB(db_path)
        try:
            go.wait()
            for i in range(25):
                db.create_token(f"cli{i}", "user", None, "cli:root")
                db.revoke_token(f"cli{i}", "cli:root")
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            db.close()

    thread = threading.Thread(target=cli)
    thread.start()
    try:
        go.set()
        lease_ids = await asyncio.gather(*(sqlite_store.lease_started(new_lease(pid=i))
                                           for i in range(40)))
        await asyncio.gather(*(sqlite_store.lease_ended(i, time.time(), "client exit", "", 0, 0, {})
                               for i in lease_ids))
        await asyncio.gather(*(sqlite_store.audit("api", "gpu.drain", f"gpu {i}") for i in range(20)))
    finally:
        await asyncio.to_thread(thread.join)
    assert errors == []
    assert sorted(lease_ids) == list(range(1, 41))
    assert len(await sqlite_store.leases("ended", 1000)) == 40
    tokens = await sqlite_store.list_tokens()
    assert len(tokens) == 25 and all(t.revoked for t in tokens)
    actions = [a.action for a in await sqlite_store.audit_log(1000)]
    assert (actions.count("token.create"), actions.count("token.revoke"),
            actions.count("gpu.drain")) == (25, 25, 20)


async def test_close_finishes_pending_calls_then_refuses(location: Path | str,
                                                         tmp_path: Path) -> None:
    store = await Store.open(location, state_dir=tmp_path)
    pending = [asyncio.create_task(store.audit("a", "x", str(i))) for i in range(10)]
    await asyncio.sleep(0)  # the tasks submit their calls
    await store.close()
    await asyncio.gather(*pending)
    await store.close()  # twice is fine
    with pytest.raises(StoreClosed):
        await store.list_tokens()
    check = StoreDB(location)
    try:
        assert len(check.audit_log()) == 10
    finally:
        check.close()


async def test_open_failure_is_raised(db_path: Path) -> None:
    db_path.write_bytes(b"garbage " * 1000)
    with pytest.raises(sqlite3.DatabaseError):
        await Store.open(db_path)


def test_gpu_states_are_replaced_as_a_whole_and_survive_a_reopen(location: Path | str) -> None:
    db = StoreDB(location)
    q = {"reason": "uncorrected ECC errors", "since": 12.5, "problems": ["ecc"]}
    mine = ["GPU-a", "GPU-b"]
    db.save_gpu_states({"GPU-a": {"draining": True, "quarantine": None},
                        "GPU-b": {"draining": False, "quarantine": q}}, mine)
    assert db.gpu_states() == {"GPU-a": {"draining": True, "quarantine": None},
                               "GPU-b": {"draining": False, "quarantine": q}}
    db.save_gpu_states({"GPU-b": {"draining": True, "quarantine": q}}, mine)  # GPU-a in service
    db.close()
    again = StoreDB(location)
    try:
        assert again.gpu_states() == {"GPU-b": {"draining": True, "quarantine": q}}
        # A shared GPU closed to new shares (a dead share's memory, issue 32) is kept too.
        again.save_gpu_states({"GPU-a": {"draining": False, "quarantine": None,
                                         "share_closed": True}}, mine)
        assert again.gpu_states() == {"GPU-a": {"draining": False, "quarantine": None,
                                                "share_closed": True}}
        again.save_gpu_states({}, mine)
        assert again.gpu_states() == {}
    finally:
        again.close()


def test_a_servers_gpu_states_leave_the_other_servers_records_alone(location: Path | str) -> None:
    """Servers sharing a store keep their GPUs' records in one table: B saving its (empty) set
    must not take A's quarantine away, or A's GPU comes back in service at A's next start."""
    a, b = StoreDB(location), StoreDB(location)
    try:
        q = {"reason": "scrub failed", "since": 1.0}
        a.save_gpu_states({"GPU-of-a": {"draining": False, "quarantine": q}}, ["GPU-of-a"])
        b.save_gpu_states({"GPU-of-b": {"draining": True, "quarantine": None}}, ["GPU-of-b"])
        b.save_gpu_states({}, ["GPU-of-b"])
        assert a.gpu_states() == {"GPU-of-a": {"draining": False, "quarantine": q}}
    finally:
        a.close()
        b.close()


def test_a_damaged_quarantine_record_still_quarantines(db_path: Path) -> None:
    db = StoreDB(db_path)
    db.close()
    conn = raw(db_path)
    conn.execute("INSERT INTO gpu_state (gpu, draining, quarantine, updated) "
                 "VALUES ('GPU-x', 0, '{not json', 1.0)")
    conn.commit()
    conn.close()
    again = StoreDB(db_path)
    try:
        st = again.gpu_states()["GPU-x"]
        assert st["quarantine"] is not None and "unreadable" in st["quarantine"]["reason"]
    finally:
        again.close()


def test_a_version_2_database_gains_the_gpu_state_table(db_path: Path) -> None:
    """A database of the gpupoold before this table: its records stay, the table is added."""
    conn = raw(db_path)
    with conn:
        for statements in store_mod.MIGRATIONS[:2]:
            for sql in statements:
                conn.execute(sql)
        conn.execute("PRAGMA user_version = 2")
        conn.execute("INSERT INTO audit (at, actor, action) VALUES (1.0, 'root', 'gpu.drain')")
    conn.close()
    db = StoreDB(db_path)
    try:
        assert db.schema_version() == SCHEMA_VERSION >= 3
        assert db.gpu_states() == {}
        assert [a.action for a in db.audit_log()] == ["gpu.drain"]
    finally:
        db.close()


# ------------------------------------------------------------------------ PostgreSQL's own
def test_a_database_url_with_a_password_is_refused() -> None:
    """The URL is in the config file: a password there is refused, and never repeated."""
    with pytest.raises(UrlError) as err:
        StoreDB("postgresql://gpupool:s3cret@db.example:5432/gpupool")
    assert "PGPASSWORD" in str(err.value) and "database_password_file" in str(err.value)
    assert "s3cret" not in str(err.value)
    with pytest.raises(UrlError, match="names no database"):
        StoreDB("postgresql://gpupool@db.example:5432/")


def test_an_unreachable_database_says_where(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nobody listens there once it is closed
    with pytest.raises(UrlError, match=rf"cannot connect to the database postgresql://x@127.0.0.1:{port}/db"):
        StoreDB(f"postgresql://x@127.0.0.1:{port}/db")
    with pytest.raises(UrlError, match="database_password_file"):
        StoreDB(f"postgresql://x@127.0.0.1:{port}/db", password_file=tmp_path / "missing")


def test_servers_sharing_a_database_migrate_once_and_see_each_others_records(pg_url: str) -> None:
    """Several gpupoold opening one fresh database at once: one migrates, all work, and what
    one writes the others read (a token made on A verifies on B)."""
    opened: list[StoreDB] = []
    errors: list[BaseException] = []

    def open_one() -> None:
        try:
            opened.append(StoreDB(pg_url))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=open_one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert not errors and len(opened) == 4
        a, b = opened[0], opened[1]
        assert b.schema_version() == SCHEMA_VERSION
        _, text = a.create_token("alice", "user", None, "server-a")
        assert b.verify_token(text).result == "ok"
        b.revoke_token("alice", "server-b")
        assert a.verify_token(text).result == "revoked"
        lease = a.lease_started(new_lease())
        assert b.get_lease(lease) is not None and [r.id for r in b.open_leases()] == [lease]
    finally:
        for d in opened:
            d.close()


def test_one_token_name_across_servers_even_when_made_at_once(pg_url: str) -> None:
    """Two servers creating the same name at the same moment: one gets it, the other is told it
    exists (not an error about ids)."""
    dbs = [StoreDB(pg_url) for _ in range(2)]
    results: list[str] = []
    barrier = threading.Barrier(2)

    def create(d: StoreDB) -> None:
        barrier.wait()
        try:
            d.create_token("shared", "user", None, "t")
            results.append("made")
        except TokenExists:
            results.append("exists")

    try:
        for _ in range(5):
            threads = [threading.Thread(target=create, args=(d,)) for d in dbs]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            dbs[0]._conn.execute("DELETE FROM tokens WHERE name = 'shared'")  # the next round
        assert results.count("made") == 5 and results.count("exists") == 5, results
    finally:
        for d in dbs:
            d.close()


def test_without_the_driver_the_message_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """psycopg is optional (the `postgresql` extra): without it a PostgreSQL URL says so."""
    monkeypatch.setitem(sys.modules, "psycopg", None)  # import psycopg -> ImportError
    with pytest.raises(UrlError, match=r"pip install 'gpupoold\[postgresql\]'"):
        StoreDB("postgresql://x@127.0.0.1:1/db")


def test_servers_register_heartbeat_and_go_down_once(location: Path | str) -> None:
    """Membership in the store: a silent server is found, marked down once (a second marker
    gets None), and only its own open leases end, with the reason; a clean stop leaves them."""
    a, c = StoreDB(location, server="a"), StoreDB(location, server="c")
    try:
        a.server_up("10.0.0.1:7070", "10.0.0.1:7071", 100.0)
        c.server_up("10.0.0.3:7070", "10.0.0.3:7071", 100.0)
        mine, theirs = a.lease_started(new_lease(pid=1)), c.lease_started(new_lease(pid=3))
        assert a.server_heartbeat(110.0) and c.server_heartbeat(101.0)
        assert a.silent_servers(105.0) == ["c"] and c.silent_servers(105.0) == []
        assert a.server_down("c", 111.0, "no heartbeat") == 1
        assert a.server_down("c", 112.0, "no heartbeat") is None  # another server got there first
        assert a.get_lease(mine).ended is None
        ended = a.get_lease(theirs)
        assert ended.ended == 111.0 and ended.end_reason == "server down" and ended.server == "c"
        assert not c.server_heartbeat(113.0)  # it was marked down while silent
        c.server_up("10.0.0.3:7070", "10.0.0.3:7071", 114.0)  # and comes back
        states = {s["name"]: s for s in a.servers()}
        assert states["c"]["state"] == "up" and states["a"]["remoting"] == "10.0.0.1:7070"
        assert a.server_down("a", 120.0, "stopped", end_leases=False) == 0
        assert a.get_lease(mine).ended is None  # a clean stop: its next start takes it over
        assert {s["name"]: s["state"] for s in c.servers()} == {"a": "down", "c": "up"}
    finally:
        a.close()
        c.close()


@pytest.mark.parametrize("location", ["sqlite", "postgresql"], indirect=True)
async def test_heartbeats_only_where_other_servers_read_them(
        location: Path | str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A shared store (PostgreSQL) gets a heartbeat every HEARTBEAT_S; a server's own SQLite file
    is registered once and then left alone (each heartbeat would be a synced write)."""
    from gpupoold.pool import membership

    monkeypatch.setattr(membership, "HEARTBEAT_S", 0.05)
    store = await Store.open(location, server="me", state_dir=tmp_path)
    m = membership.Membership(store, "127.0.0.1:7070", "127.0.0.1:7071")
    try:
        await m.start()
        await asyncio.sleep(0.5)
        (me,) = await store.servers()
        beating = me["heartbeat"] > me["started"]
        assert beating == (store.path is None), me
        await m.close()
        (me,) = await store.servers()
        assert me["state"] == "down" and me["down_reason"] == "stopped"
    finally:
        await store.close()
