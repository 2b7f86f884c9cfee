"""gpupoold's records in SQLite (`<state_dir>/gpupoold.db`) or PostgreSQL (`database =
"postgresql://..."`, store/postgres.py): tokens, lease history, audit log, and the GPUs that stay
drained or quarantined across restarts. One set of queries and migrations serves both: they are
written in the SQL both understand, and postgres.py translates placeholders and column types.

Two faces over one schema:

- `StoreDB`, synchronous, owns one `sqlite3` connection that may be used only by the thread that
  opened it (sqlite3's own check enforces this). The admin CLI (`gpupoold token ...`) uses it
  directly, possibly while the daemon runs: the database is in WAL mode (readers never block the
  writer) and every write transaction starts with `BEGIN IMMEDIATE` under a busy timeout, so two
  processes writing at once wait for each other instead of failing.
- `Store`, the daemon's asynchronous API: a `StoreDB` living in one dedicated worker thread (a
  single-thread executor), so no SQLite call ever blocks the event loop and calls run one at a
  time in the order they were made. Its records go through the record spooler
  (store/replay.py): while the database is unreachable they wait on disk, not in memory.

What the calls return and take (tokens, leases, audit records) is in store/records.py.

The schema is versioned with `PRAGMA user_version` (PostgreSQL: the table `gpupool_schema`);
`MIGRATIONS[n]` brings version n to n+1 (PostgreSQL: under an advisory lock, so that servers
starting together migrate once). A
database written by a newer gpupoold (a higher version than this one knows) is refused rather
than guessed at. Times are Unix seconds (float). Token secrets are never stored: only the SHA-256
of the secret (store/tokens.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import os
import sqlite3
import time
from collections.abc import Awaitable, Callable, Collection, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

from gpupoold.store import fleet, postgres
from gpupoold.store.records import (
    _NEW_LEASE_FIELDS,
    AuditRecord,
    LeaseFilter,
    LeaseRecord,
    NewLease,
    ServerRegistration,
    TokenCheck,
    TokenRecord,
)
from gpupoold.store.replay import RecordSpooler, SpoolQueries
from gpupoold.store.spool import SPOOL_NAME, Spool
from gpupoold.store.tokens import (
    check_role,
    check_token_name,
    check_weight,
    format_utc,
    hash_secret,
    new_token,
    parse_token,
    secret_matches,
)
from gpupoold.store.usage import UsageQueries

DB_NAME = "gpupoold.db"
BUSY_TIMEOUT_S = 15.0  # how long a writer waits for another process's transaction
LEASE_STATES = ("active", "ended", "all")
CHECK_RESULTS = ("ok", "missing", "malformed", "unknown", "revoked", "expired")
_NEW_ID_TRIES = 8  # a 48-bit token id colliding even twice means something else is wrong

T = TypeVar("T")
log = logging.getLogger("gpupoold.store")

# MIGRATIONS[n]: the statements that bring schema version n to n + 1 (run in one transaction).
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (  # v1
        """CREATE TABLE tokens (
            id TEXT PRIMARY KEY,
            name TEXT NOT NULL UNIQUE,
            role TEXT NOT NULL CHECK (role IN ('user', 'admin')),
            secret_sha256 TEXT NOT NULL,
            created REAL NOT NULL,
            expires REAL,
            revoked REAL,
            last_used REAL,
            created_by TEXT NOT NULL DEFAULT ''
        )""",
        """CREATE TABLE leases (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            gpu_index INTEGER NOT NULL,
            gpu_uuid TEXT NOT NULL DEFAULT '',
            gpu_name TEXT NOT NULL DEFAULT '',
            simulated INTEGER NOT NULL DEFAULT 0,
            token_name TEXT NOT NULL DEFAULT '',
            client_host TEXT NOT NULL DEFAULT '',
            client_user TEXT NOT NULL DEFAULT '',
            client_pid INTEGER NOT NULL DEFAULT 0,
            program TEXT NOT NULL DEFAULT '',
            peer TEXT NOT NULL DEFAULT '',
            request TEXT NOT NULL DEFAULT '',
            queued_s REAL NOT NULL DEFAULT 0,
            started REAL NOT NULL,
            ended REAL,
            end_reason TEXT,
            end_detail TEXT,
            bytes_h2d INTEGER NOT NULL DEFAULT 0,
            bytes_d2h INTEGER NOT NULL DEFAULT 0,
            calls TEXT NOT NULL DEFAULT '{}',
            scrub_ok INTEGER,
            scrub TEXT
        )""",
        "CREATE INDEX leases_open ON leases (id) WHERE ended IS NULL",
        """CREATE TABLE audit (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            at REAL NOT NULL,
            actor TEXT NOT NULL,
            action TEXT NOT NULL,
            target TEXT NOT NULL DEFAULT '',
            detail TEXT NOT NULL DEFAULT ''
        )""",
    ),
    (  # v2: module image bytes the worker received from the client (0 for older records)
        "ALTER TABLE leases ADD COLUMN module_bytes INTEGER NOT NULL DEFAULT 0",
    ),
    (  # v3: GPUs an operator drained or the scrub quarantined, kept across restarts (they were
       # in <state_dir>/gpu-state.json before; the lease manager imports that file once)
        """CREATE TABLE gpu_state (
            gpu TEXT PRIMARY KEY,
            draining INTEGER NOT NULL DEFAULT 0,
            quarantine TEXT,
            updated REAL NOT NULL
        )""",
    ),
    (  # v4: idle detach (pool/detach.py): how often and how long a lease gave its GPU back, and
       # every transition (attached, detached, ...) with its GPU and detail
        "ALTER TABLE leases ADD COLUMN detaches INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE leases ADD COLUMN detached_s REAL NOT NULL DEFAULT 0",
        """CREATE TABLE lease_events (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            lease_id INTEGER NOT NULL,
            at REAL NOT NULL,
            state TEXT NOT NULL,
            gpu_index INTEGER,
            detail TEXT NOT NULL DEFAULT ''
        )""",
        "CREATE INDEX lease_events_lease ON lease_events (lease_id, id)",
    ),
    (  # v5: servers sharing the store (PostgreSQL): who is up, and which server ran each lease
        "ALTER TABLE leases ADD COLUMN server TEXT NOT NULL DEFAULT ''",
        """CREATE TABLE servers (
            name TEXT PRIMARY KEY,
            remoting TEXT NOT NULL DEFAULT '',
            http TEXT NOT NULL DEFAULT '',
            started REAL NOT NULL,
            heartbeat REAL NOT NULL,
            down REAL,
            down_reason TEXT NOT NULL DEFAULT ''
        )""",
    ),
    (  # v6: the fleet (store/fleet.py): every server's GPUs, and the one queue for them all
        """CREATE TABLE fleet_gpus (
            server TEXT NOT NULL,
            gpu_index INTEGER NOT NULL,
            uuid TEXT NOT NULL DEFAULT '',
            name TEXT NOT NULL DEFAULT '',
            memory_total INTEGER NOT NULL DEFAULT 0,
            simulated INTEGER NOT NULL DEFAULT 0,
            state TEXT NOT NULL,
            free INTEGER NOT NULL DEFAULT 0,
            lease_id INTEGER,
            token TEXT NOT NULL DEFAULT '',
            updated REAL NOT NULL,
            holder INTEGER,
            holder_token TEXT NOT NULL DEFAULT '',
            PRIMARY KEY (server, gpu_index)
        )""",
        """CREATE TABLE fleet_queue (
            ticket INTEGER PRIMARY KEY AUTOINCREMENT,
            server TEXT NOT NULL,
            token TEXT NOT NULL,
            client TEXT NOT NULL,
            request TEXT NOT NULL,
            only_gpus TEXT,
            redirectable INTEGER NOT NULL DEFAULT 1,
            joined REAL NOT NULL,
            state TEXT NOT NULL DEFAULT 'waiting',
            assigned_server TEXT,
            assigned_gpu INTEGER,
            assigned_at REAL
        )""",
    ),
    (  # v7: what the other servers need to reach this one safely (issue 35): the fingerprint of
        # its remoting TLS identity (clients follow a redirect only with it), the HTTP address
        # others must use (`http_advertise`; `http` keeps the bound one), its scheme and the
        # fingerprint of its HTTPS certificate (fleet admin actions are forwarded with that pin)
        "ALTER TABLE servers ADD COLUMN fingerprint TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE servers ADD COLUMN http_address TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE servers ADD COLUMN http_scheme TEXT NOT NULL DEFAULT ''",
        "ALTER TABLE servers ADD COLUMN http_fingerprint TEXT NOT NULL DEFAULT ''",
        # the server that wrote an audit record: on a shared store "gpu 0" names one GPU of
        # each server, and an admin action may be sent to one server for another
        "ALTER TABLE audit ADD COLUMN server TEXT NOT NULL DEFAULT ''",
    ),
    (  # v8: each server's leases off a GPU (idly detached, or called back and not yet seated):
        # they count toward their token's max_gpus_per_token in the whole fleet (issue 29)
        """CREATE TABLE fleet_away (
            server TEXT NOT NULL,
            lease_id INTEGER NOT NULL,
            token TEXT NOT NULL,
            PRIMARY KEY (server, lease_id)
        )""",
    ),
    (  # v9: GPU time accounting (issue 33, pool/usage.py): each lease's seconds on a GPU and
        # busy, and per GPU, minute and token the same (kept `usage_retention_days`)
        "ALTER TABLE leases ADD COLUMN leased_s REAL NOT NULL DEFAULT 0",
        "ALTER TABLE leases ADD COLUMN busy_s REAL NOT NULL DEFAULT 0",
        """CREATE TABLE gpu_usage (
            server TEXT NOT NULL,
            gpu_index INTEGER NOT NULL,
            minute REAL NOT NULL,
            token TEXT NOT NULL,
            leased_s REAL NOT NULL DEFAULT 0,
            busy_s REAL NOT NULL DEFAULT 0,
            PRIMARY KEY (server, gpu_index, minute, token)
        )""",
        "CREATE INDEX gpu_usage_minute ON gpu_usage (minute)",
    ),
    (  # v10: time a GPU served others while a lease detached from it was away (store/usage.py)
        "ALTER TABLE leases ADD COLUMN reused_s REAL NOT NULL DEFAULT 0",
        "ALTER TABLE gpu_usage ADD COLUMN reused_s REAL NOT NULL DEFAULT 0",
    ),
    (  # v11: the records a server replayed from its spool (store/spool.py, issue 34), by id:
        # a replay that runs again (gpupoold stopped between the database's commit and the
        # spool's removal) writes each record once. Removed once the spool is gone.
        """CREATE TABLE spool_applied (
            id TEXT PRIMARY KEY,
            server TEXT NOT NULL DEFAULT '',
            applied REAL NOT NULL
        )""",
    ),
    (  # v12: every GPU of a lease of several GPUs (issue 37), program order, comma-separated;
        # '' for a lease of one GPU (gpu_index) and in older records
        "ALTER TABLE leases ADD COLUMN gpus TEXT NOT NULL DEFAULT ''",
    ),
    (  # v13: a token's share weight on shared GPUs (issue 32, item 4: worker/pacing.c)
        "ALTER TABLE tokens ADD COLUMN weight INTEGER NOT NULL DEFAULT 1",
    ),
    (  # v14: a fleet queue's client asking for several GPUs at once from one server (issue 37):
        # how many, and the GPUs of that server the fleet's match gave it (JSON list, in order);
        # and how many GPUs a lease off its GPUs comes back to (max_gpus_per_token counts them)
        "ALTER TABLE fleet_queue ADD COLUMN gpus INTEGER NOT NULL DEFAULT 1",
        "ALTER TABLE fleet_queue ADD COLUMN assigned_gpus TEXT",
        "ALTER TABLE fleet_away ADD COLUMN gpus INTEGER NOT NULL DEFAULT 1",
    ),
    (  # v15: every GPU an idle-detach event of a lease of several GPUs names (issue 37): those
        # it left, those it came back on; program order, comma-separated; '' for a lease of one
        # GPU (gpu_index) and in older records, which name device 0's GPU only
        "ALTER TABLE lease_events ADD COLUMN gpus TEXT NOT NULL DEFAULT ''",
    ),
    (  # v16: a shared GPU a dead share's worker may have left memory on, unzeroed (issue 32):
        # it takes no new share until scrubbed whole, also after a restart that takes its other
        # shares over (pool/takeover.py)
        "ALTER TABLE gpu_state ADD COLUMN share_closed INTEGER NOT NULL DEFAULT 0",
    ),
    (  # v17: a lease spread over several servers (issue 37 item 3): its fleet queue row, and
        # the parts the match gave it (JSON [[server, [GPU, ...]], ...]; NULL: one server's);
        # each part's lease record: the group (the ticket), its part and how many (else 0s)
        "ALTER TABLE fleet_queue ADD COLUMN spread INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE fleet_queue ADD COLUMN assigned_parts TEXT",
        "ALTER TABLE leases ADD COLUMN spread_group INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE leases ADD COLUMN part INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE leases ADD COLUMN parts INTEGER NOT NULL DEFAULT 0",
    ),
)
SCHEMA_VERSION = len(MIGRATIONS)


# ------------------------------------------------------------------------------------ errors
@functools.cache
def store_errors() -> tuple[type[BaseException], ...]:
    """What a store call raises when the database cannot be used (PostgreSQL down, the
    connection lost, a locked SQLite file): callers that keep going without it catch these."""
    return (StoreError, sqlite3.OperationalError, OSError, *postgres.driver_errors())


class StoreError(Exception):
    """A store problem; the message says what happened."""


class NotFound(StoreError):
    """No token with that name, or no lease with that id."""


class TokenExists(StoreError):
    """A token with that name exists already (revoked tokens keep their name)."""


class StoreClosed(StoreError):
    """The store was used after close()."""


class SchemaTooNew(StoreError):
    """The database was written by a newer gpupoold."""


# ----------------------------------------------------------------------------------- records
def _token(row: Any) -> TokenRecord:
    return TokenRecord(id=row["id"], name=row["name"], role=row["role"], created=row["created"],
                       expires=row["expires"], revoked=row["revoked"],
                       last_used=row["last_used"], created_by=row["created_by"],
                       weight=int(row["weight"]))


def _counter(value: int) -> int:
    """A byte or call count as SQLite's INTEGER holds it: clamped to 0 .. 2^63 - 1 (the counts
    come from workers, whose numbers are never trusted to fit)."""
    return min(max(int(value), 0), (1 << 63) - 1)


def _lease(row: Any) -> LeaseRecord:
    values = {key: row[key] for key in row.keys()}
    values["simulated"] = bool(values["simulated"])
    values["calls"] = json.loads(values["calls"] or "{}")
    values["scrub_ok"] = None if values["scrub_ok"] is None else bool(values["scrub_ok"])
    values["scrub"] = None if values["scrub"] is None else json.loads(values["scrub"])
    values["gpus"] = tuple(int(i) for i in str(values.get("gpus") or "").split(",") if i)
    return LeaseRecord(**values)


def _audit(row: Any) -> AuditRecord:
    return AuditRecord(id=row["id"], at=row["at"], actor=row["actor"], action=row["action"],
                       target=row["target"], detail=row["detail"], server=row["server"])


def _expiry_text(expires: float | None) -> str:
    return "never" if expires is None else format_utc(expires)


# ---------------------------------------------------------------------- the synchronous store
class StoreDB(UsageQueries, SpoolQueries, fleet.SpreadQueries):
    """One database connection (SQLite, or PostgreSQL for a URL), usable only from the thread
    that created this object."""

    def __init__(self, location: Path | str, password_file: Path | None = None,
                 server: str = "") -> None:
        self.server = server  # this server's name, written into its lease records
        self._in_write = False  # a write transaction is open (`_write`)
        if postgres.is_url(location):
            assert isinstance(location, str)
            self.path = None
            self.where = postgres.redacted(location)
            self._pg = True
            pg = postgres.PgConnection(location, password_file)
            self._conn: Any = pg
            self._integrity_error: type[Exception] = pg.integrity_error
            try:
                self._migrate()
            except BaseException:
                pg.close()
                raise
            return
        self._pg = False
        self._integrity_error = sqlite3.IntegrityError
        self.path = Path(location)
        self.where = str(self.path)
        if not self.path.exists():
            # Created here rather than by SQLite to choose the mode: lease history says who used
            # the GPUs from where; SQLite gives its -wal and -shm files the same mode.
            with contextlib.suppress(FileExistsError):
                os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        self._conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        try:
            self._conn.row_factory = sqlite3.Row
            self._conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            self._conn.execute("PRAGMA journal_mode = WAL")
            self._conn.execute("PRAGMA synchronous = FULL")  # a committed record survives a crash
            self._conn.execute("PRAGMA foreign_keys = ON")
            self._migrate()
        except BaseException:
            self._conn.close()
            raise

    def close(self) -> None:
        self._conn.close()

    @contextlib.contextmanager
    def _write(self) -> Iterator[Any]:
        """A write transaction. SQLite: IMMEDIATE takes the write lock at once (waiting up to
        the busy timeout), so a transaction never fails half-way for another process's lock;
        PostgreSQL locks rows as the statements reach them. A call made inside another's
        transaction (`apply_spooled`) joins it."""
        if self._in_write:
            yield self._conn
            return
        self._conn.execute("BEGIN" if self._pg else "BEGIN IMMEDIATE")
        self._in_write = True
        try:
            yield self._conn
        except BaseException:
            self._in_write = False
            self._conn.execute("ROLLBACK")
            raise
        self._in_write = False
        self._conn.execute("COMMIT")

    def _insert(self, db: Any, sql: str, params: Any, key: str = "id") -> int:
        """Run an INSERT; the new row's id (its column `key`)."""
        if self._pg:
            return int(db.execute(f"{sql} RETURNING {key}", params).fetchone()[0])
        return int(db.execute(sql, params).lastrowid or 0)

    def _version(self, db: Any) -> int:
        if not self._pg:
            return int(db.execute("PRAGMA user_version").fetchone()[0])
        db.execute("CREATE TABLE IF NOT EXISTS gpupool_schema (version BIGINT NOT NULL)")
        row = db.execute("SELECT version FROM gpupool_schema").fetchone()
        return 0 if row is None else int(row[0])

    def schema_version(self) -> int:
        return self._version(self._conn)

    def _migrate(self) -> None:
        with self._write() as db:
            if self._pg:  # one server migrates, the others wait and find it done
                db.execute("SELECT pg_advisory_xact_lock(7070707)")
            version = self._version(db)
            if version > SCHEMA_VERSION:
                raise SchemaTooNew(
                    f"{self.where} has schema version {version}, written by a newer gpupoold; "
                    f"this one knows up to version {SCHEMA_VERSION}: upgrade gpupoold (or use a "
                    f"backup of the database from before the upgrade)")
            for statements in MIGRATIONS[version:]:
                for sql in statements:
                    db.execute(postgres.ddl(sql) if self._pg else sql)
            if version != SCHEMA_VERSION:
                if not self._pg:
                    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                else:
                    db.execute("DELETE FROM gpupool_schema")
                    db.execute("INSERT INTO gpupool_schema (version) VALUES (?)",
                               (SCHEMA_VERSION,))

    def _add_audit(self, db: Any, actor: str, action: str, target: str,
                   detail: str, at: float | None = None) -> int:
        return self._insert(db, "INSERT INTO audit (at, actor, action, target, detail, server) "
                                "VALUES (?, ?, ?, ?, ?, ?)",
                            (time.time() if at is None else at, actor, action, target, detail,
                             self.server))

    # ------------------------------------------------------------------------------- tokens
    def create_token(self, name: str, role: str, expires: float | None, actor: str,
                     weight: int = 1) -> tuple[TokenRecord, str]:
        """A new token: its record and its full text (shown once, never stored). `weight`: its
        shares' weight on a shared GPU."""
        check_token_name(name, allow_reserved=True)
        check_role(role)
        check_weight(weight)
        with self._write() as db:
            if db.execute("SELECT 1 FROM tokens WHERE name = ?", (name,)).fetchone():
                raise TokenExists(f"a token named {name!r} already exists")
            record, text = self._insert_token(db, name, role, expires, actor)
            if weight != 1:
                db.execute("UPDATE tokens SET weight = ? WHERE id = ?", (weight, record.id))
                record = dataclasses.replace(record, weight=weight)
            self._add_audit(db, actor, "token.create", f"token {name}",
                            f"role {role}, expires {_expiry_text(expires)}, id {record.id}"
                            + (f", weight {weight}" if weight != 1 else ""), record.created)
        return record, text

    def set_token_weight(self, name: str, weight: int, actor: str) -> TokenRecord:
        """Set the share weight of the token `name` (NotFound if there is none); shares that
        start from now on get it, running ones keep theirs."""
        check_weight(weight)
        with self._write() as db:
            row = db.execute("SELECT * FROM tokens WHERE name = ?", (name,)).fetchone()
            if row is None:
                raise NotFound(f"no token named {name!r}")
            record = _token(row)
            if record.weight != weight:
                db.execute("UPDATE tokens SET weight = ? WHERE id = ?", (weight, record.id))
                self._add_audit(db, actor, "token.weight", f"token {name}",
                                f"weight {record.weight} -> {weight}, id {record.id}", time.time())
                record = dataclasses.replace(record, weight=weight)
        return record

    def _insert_token(self, db: Any, name: str, role: str,
                      expires: float | None, actor: str) -> tuple[TokenRecord, str]:
        now = time.time()
        for _ in range(_NEW_ID_TRIES):
            token_id, secret, text = new_token()
            # A failed statement spoils a PostgreSQL transaction: the savepoint keeps it usable.
            db.execute("SAVEPOINT new_token")
            try:
                db.execute("INSERT INTO tokens (id, name, role, secret_sha256, created, expires, "
                           "created_by) VALUES (?, ?, ?, ?, ?, ?, ?)",
                           (token_id, name, role, hash_secret(secret), now, expires, actor))
            except self._integrity_error:
                db.execute("ROLLBACK TO SAVEPOINT new_token")
                if db.execute("SELECT 1 FROM tokens WHERE name = ?", (name,)).fetchone():
                    # another server of the fleet made it since the caller's check
                    raise TokenExists(f"a token named {name!r} already exists") from None
                continue  # the random id is taken
            db.execute("RELEASE SAVEPOINT new_token")
            return TokenRecord(token_id, name, role, now, expires, None, None, actor), text
        raise StoreError("could not find a free token id")  # pragma: no cover

    def replace_token(self, name: str, role: str, actor: str) -> tuple[TokenRecord, str]:
        """Create the token `name` afresh (never expiring), deleting a previous one of that
        name in the same transaction: its secret stops working at once."""
        check_token_name(name, allow_reserved=True)
        check_role(role)
        with self._write() as db:
            old = db.execute("SELECT id FROM tokens WHERE name = ?", (name,)).fetchone()
            db.execute("DELETE FROM tokens WHERE name = ?", (name,))
            record, text = self._insert_token(db, name, role, None, actor)
            detail = f"role {role}, id {record.id}" + (f", replaces id {old['id']}" if old else "")
            self._add_audit(db, actor, "token.rotate" if old else "token.create",
                            f"token {name}", detail, record.created)
        return record, text

    def list_tokens(self) -> list[TokenRecord]:
        rows = self._conn.execute("SELECT * FROM tokens ORDER BY created, name").fetchall()
        return [_token(r) for r in rows]

    def get_token(self, name: str) -> TokenRecord | None:
        row = self._conn.execute("SELECT * FROM tokens WHERE name = ?", (name,)).fetchone()
        return None if row is None else _token(row)

    def revoke_token(self, name: str, actor: str) -> TokenRecord:
        """Revoke the token `name` (NotFound if there is none). Revoking a revoked token changes
        nothing and is not audited again."""
        with self._write() as db:
            row = db.execute("SELECT * FROM tokens WHERE name = ?", (name,)).fetchone()
            if row is None:
                raise NotFound(f"no token named {name!r}")
            record = _token(row)
            if record.revoked is None:
                now = time.time()
                db.execute("UPDATE tokens SET revoked = ? WHERE id = ?", (now, record.id))
                self._add_audit(db, actor, "token.revoke", f"token {name}",
                                f"role {record.role}, id {record.id}", now)
                record = dataclasses.replace(record, revoked=now)
        return record

    def verify_token(self, token: str, now: float | None = None) -> TokenCheck:
        """Check a presented token's text. The secret is compared in constant time, also when the
        id is unknown; revoked and expired are only told to whoever holds the right secret."""
        token = token.strip()
        if not token:
            return TokenCheck("missing")
        parsed = parse_token(token)
        if parsed is None:
            return TokenCheck("malformed")
        row = self._conn.execute("SELECT * FROM tokens WHERE id = ?", (parsed.id,)).fetchone()
        if not secret_matches(parsed.secret, None if row is None else row["secret_sha256"]):
            return TokenCheck("unknown", token_id=parsed.id)
        record = _token(row)
        state = record.state(now)
        return TokenCheck("ok" if state == "valid" else state, record, parsed.id)

    def touch_token(self, token_id: str, when: float) -> None:
        """Note that the token was used at `when` (never moves last_used backwards)."""
        with self._write() as db:
            db.execute("UPDATE tokens SET last_used = ? WHERE id = ? "
                       "AND (last_used IS NULL OR last_used < ?)", (when, token_id, when))

    # ------------------------------------------------------------------------------- leases
    def lease_started(self, lease: NewLease, spread: tuple[int, int, int] | None = None) -> int:
        """A new lease's record; its id. `spread`: a spread lease's (group, part, parts)."""
        fields = list(_NEW_LEASE_FIELDS) + (["server"] if self.server else [])
        values = [getattr(lease, f) for f in _NEW_LEASE_FIELDS] + ([self.server] if self.server else [])
        if spread is not None:
            fields += ["spread_group", "part", "parts"]
            values += [int(v) for v in spread]
        marks = ", ".join("?" * len(values))
        with self._write() as db:
            return self._insert(db, f"INSERT INTO leases ({', '.join(fields)}) VALUES ({marks})",
                                values)

    def lease_gpus(self, lease_id: int, gpus: list[int]) -> None:
        """Every GPU of a lease of several GPUs, program order (issue 37)."""
        with self._write() as db:
            cur = db.execute("UPDATE leases SET gpus = ? WHERE id = ?",
                             (",".join(str(int(i)) for i in gpus), lease_id))
            if cur.rowcount == 0:
                raise NotFound(f"no lease {lease_id}")

    def lease_ended(self, lease_id: int, ended: float, reason: str, detail: str,
                    bytes_h2d: int, bytes_d2h: int, calls: dict[str, int],
                    module_bytes: int = 0) -> None:
        with self._write() as db:
            cur = db.execute(
                "UPDATE leases SET ended = ?, end_reason = ?, end_detail = ?, bytes_h2d = ?, "
                "bytes_d2h = ?, calls = ?, module_bytes = ? WHERE id = ?",
                (ended, reason, detail, _counter(bytes_h2d), _counter(bytes_d2h),
                 json.dumps(calls, sort_keys=True), _counter(module_bytes), lease_id))
            if cur.rowcount == 0:
                raise NotFound(f"no lease {lease_id}")

    def lease_scrubbed(self, lease_id: int, ok: bool, result: dict[str, Any]) -> None:
        with self._write() as db:
            cur = db.execute("UPDATE leases SET scrub_ok = ?, scrub = ? WHERE id = ?",
                             (int(ok), json.dumps(result, default=str), lease_id))
            if cur.rowcount == 0:
                raise NotFound(f"no lease {lease_id}")

    def open_leases(self) -> list[LeaseRecord]:
        rows = self._conn.execute("SELECT * FROM leases WHERE ended IS NULL ORDER BY id")
        return [_lease(r) for r in rows.fetchall()]

    def lease_event(self, lease_id: int, at: float, state: str, gpu_index: int | None,
                    detail: str, detaches: int, detached_s: float,
                    gpus: Sequence[int] = ()) -> None:
        """A lease changed state (idle detach): the event, and the lease's running totals.
        `gpus`: every GPU of a lease of several that the event names (left, or came back on),
        program order, `gpu_index` (device 0's) first; kept only when there are several."""
        names = ",".join(str(int(i)) for i in gpus) if len(gpus) > 1 else ""
        with self._write() as db:
            cur = db.execute("UPDATE leases SET detaches = ?, detached_s = ? WHERE id = ?",
                             (_counter(detaches), max(0.0, detached_s), lease_id))
            if cur.rowcount == 0:
                raise NotFound(f"no lease {lease_id}")
            db.execute("INSERT INTO lease_events (lease_id, at, state, gpu_index, detail, gpus) "
                       "VALUES (?, ?, ?, ?, ?, ?)", (lease_id, at, state, gpu_index, detail, names))
            if state == "attached":
                # Its detach's scrub (recorded as its scrub) is no longer the scrub after its
                # last use: until the scrub after its end, the record says "not yet scrubbed".
                db.execute("UPDATE leases SET scrub_ok = NULL, scrub = NULL WHERE id = ?",
                           (lease_id,))

    def lease_events(self, lease_id: int) -> list[dict[str, Any]]:
        """The lease's idle-detach events, oldest first: "gpu" is device 0's GPU, "gpus" every
        GPU the event names (program order; [gpu] for a lease of one GPU, and for an event of a
        lease of several written before schema v15, which kept device 0's only)."""
        rows = self._conn.execute("SELECT at, state, gpu_index, detail, gpus FROM lease_events "
                                  "WHERE lease_id = ? ORDER BY id", (lease_id,))
        return [{"at": r["at"], "state": r["state"], "gpu": r["gpu_index"],
                 "gpus": [int(i) for i in str(r["gpus"] or "").split(",") if i]
                 or ([] if r["gpu_index"] is None else [r["gpu_index"]]),
                 "detail": r["detail"]} for r in rows.fetchall()]

    def unscrubbed_last_leases(self) -> list[LeaseRecord]:
        """Ended leases still waiting for their scrub's result: only each GPU's latest lease
        can be (a GPU is scrubbed before its next lease), when the daemon stopped between the
        lease's end and its scrub."""
        rows = self._conn.execute(
            "SELECT * FROM leases WHERE id IN (SELECT MAX(id) FROM leases GROUP BY gpu_index) "
            "AND ended IS NOT NULL AND scrub_ok IS NULL ORDER BY id")
        return [_lease(r) for r in rows.fetchall()]

    # ---------------------------------------------------------------------------- GPU state
    def gpu_states(self) -> dict[str, dict[str, Any]]:
        """{GPU UUID (its index when it has none): {"draining": bool, "quarantine": dict|None}}
        for every GPU that is drained, draining or quarantined, or closed to new shares (then
        with "share_closed": True; the key is absent for the others)."""
        out: dict[str, dict[str, Any]] = {}
        for gpu, draining, quarantine, share_closed in self._conn.execute(
                "SELECT gpu, draining, quarantine, share_closed FROM gpu_state ORDER BY gpu"):
            try:
                q = json.loads(quarantine) if quarantine else None
            except ValueError:
                q = "unreadable quarantine record in the database"
            if q is not None and not isinstance(q, dict):  # damaged: still quarantined, saying so
                q = {"reason": str(q), "since": 0.0}
            out[gpu] = {"draining": bool(draining), "quarantine": q}
            if share_closed:
                out[gpu]["share_closed"] = True
        return out

    def save_gpu_states(self, states: dict[str, dict[str, Any]], gpus: Collection[str]) -> None:
        """Replace the records of this server's GPUs (`gpus`: their keys, UUID or index) with
        `states` (as gpu_states returns them) in one transaction. The records of other GPUs
        stay: servers sharing a store keep theirs in the same table, and one server's save
        must never take another's quarantine away."""
        now = time.time()
        with self._write() as db:
            for gpu in sorted(set(gpus) | set(states)):
                db.execute("DELETE FROM gpu_state WHERE gpu = ?", (gpu,))
            for gpu, st in states.items():
                q = st.get("quarantine")
                db.execute("INSERT INTO gpu_state (gpu, draining, quarantine, share_closed, "
                           "updated) VALUES (?, ?, ?, ?, ?)",
                           (gpu, int(bool(st.get("draining"))),
                            None if q is None else json.dumps(q, default=str),
                            int(bool(st.get("share_closed"))), now))

    def leases(self, state: str = "all", limit: int = 100, before: int | None = None,
               filters: LeaseFilter | None = None) -> list[LeaseRecord]:
        """Lease records, newest first: `active` (not ended), `ended` or `all`; only ids below
        `before` when given (the next page); only those `filters` lets through."""
        if state not in LEASE_STATES:
            raise ValueError(f"lease state must be one of {', '.join(LEASE_STATES)}, got {state!r}")
        where = {"active": ["ended IS NULL"], "ended": ["ended IS NOT NULL"], "all": []}[state]
        args: list[Any] = []
        if before is not None:
            where.append("id < ?")
            args.append(before)
        f = filters or LeaseFilter()
        for column, value in (("token_name", f.token), ("client_user", f.user)):
            if value is not None:
                where.append(f"{column} = ?")
                args.append(value)
        if f.gpu is not None:  # any GPU of the lease: its first, or one of `gpus` (v12)
            where.append("(gpu_index = ? OR ',' || gpus || ',' LIKE ?)")
            args += [f.gpu, f"%,{int(f.gpu)},%"]
        if f.since is not None:  # started at or after
            where.append("started >= ?")
            args.append(f.since)
        if f.until is not None:  # started before
            where.append("started < ?")
            args.append(f.until)
        if f.ended_after is not None:
            where.append("(ended IS NULL OR ended >= ?)")
            args.append(f.ended_after)
        sql = "SELECT * FROM leases" + (f" WHERE {' AND '.join(where)}" if where else "")
        rows = self._conn.execute(sql + " ORDER BY id DESC LIMIT ?", (*args, limit)).fetchall()
        return [_lease(r) for r in rows]

    def get_lease(self, lease_id: int) -> LeaseRecord | None:
        row = self._conn.execute("SELECT * FROM leases WHERE id = ?", (lease_id,)).fetchone()
        return None if row is None else _lease(row)

    # ------------------------------------------------------------------------------ servers
    def server_up(self, remoting: str, http: str, now: float,
                  reg: ServerRegistration | None = None) -> None:
        """This server (self.server) starts: registered, or back from being marked down.
        `reg`: how the others reach it safely (fingerprints, HTTP address and scheme)."""
        reg = reg or ServerRegistration()
        with self._write() as db:
            db.execute("INSERT INTO servers (name, remoting, http, started, heartbeat, "
                       "fingerprint, http_address, http_scheme, http_fingerprint) "
                       "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (name) DO UPDATE SET "
                       "remoting = excluded.remoting, http = excluded.http, "
                       "started = excluded.started, heartbeat = excluded.heartbeat, "
                       "fingerprint = excluded.fingerprint, "
                       "http_address = excluded.http_address, "
                       "http_scheme = excluded.http_scheme, "
                       "http_fingerprint = excluded.http_fingerprint, "
                       "down = NULL, down_reason = ''",
                       (self.server, remoting, http, now, now, reg.fingerprint,
                        reg.http_address, reg.http_scheme, reg.http_fingerprint))

    def server_heartbeat(self, now: float) -> bool:
        """This server is alive at `now`; False when another had marked it down meanwhile (it
        was silent too long: its leases are ended in the history)."""
        with self._write() as db:
            return db.execute("UPDATE servers SET heartbeat = ? WHERE name = ? AND down IS NULL",
                              (now, self.server)).rowcount == 1

    def server_down(self, name: str, now: float, reason: str, end_leases: bool = True,
                    ) -> int | None:
        """Mark `name` down and, with `end_leases`, end its open leases ("server down"); the
        number of leases ended, or None when it was down already (another server got there
        first). A server stopping cleanly keeps its leases open: its next start takes them
        over."""
        with self._write() as db:
            if db.execute("UPDATE servers SET down = ?, down_reason = ? "
                          "WHERE name = ? AND down IS NULL", (now, reason, name)).rowcount != 1:
                return None
            if not end_leases:
                return 0
            return db.execute("UPDATE leases SET ended = ?, end_reason = 'server down', "
                              "end_detail = ? WHERE server = ? AND ended IS NULL",
                              (now, reason, name)).rowcount

    def clock(self) -> float:
        """The database's clock, in seconds since the epoch: the one clock every server of a
        fleet reads the same, for heartbeats and the judgement of silence (a server's own clock
        may jump)."""
        sql = ("SELECT EXTRACT(EPOCH FROM clock_timestamp())" if self.path is None
               else "SELECT (julianday('now') - 2440587.5) * 86400.0")
        return float(self._conn.execute(sql).fetchone()[0])

    def silent_servers(self, before: float) -> list[str]:
        """Servers up whose last heartbeat is older than `before` (not this one)."""
        rows = self._conn.execute("SELECT name FROM servers WHERE down IS NULL AND heartbeat < ? "
                                  "AND name <> ? ORDER BY name", (before, self.server))
        return [r[0] for r in rows.fetchall()]

    def servers(self) -> list[dict[str, Any]]:
        rows = self._conn.execute("SELECT * FROM servers ORDER BY name").fetchall()
        return [{"name": r["name"], "remoting": r["remoting"], "http": r["http"],
                 "fingerprint": r["fingerprint"], "http_address": r["http_address"],
                 "http_scheme": r["http_scheme"], "http_fingerprint": r["http_fingerprint"],
                 "started": r["started"], "heartbeat": r["heartbeat"],
                 "state": "up" if r["down"] is None else "down", "down_since": r["down"],
                 "down_reason": r["down_reason"]} for r in rows]

    # -------------------------------------------------------------------------------- fleet
    def fleet_sync(self, inp: fleet.SyncInput, match: fleet.Matcher) -> fleet.SyncResult:
        """One turn of this server in the fleet's shared state (store/fleet.py)."""
        with self._write() as db:
            return fleet.sync(db, inp, match, self._insert, time.time())

    def fleet_snapshot(self) -> tuple[list[fleet.GpuRow], list[fleet.QueueRow]]:
        return fleet.snapshot(self._conn)

    # -------------------------------------------------------------------------------- audit
    def audit(self, actor: str, action: str, target: str, detail: str = "",
              at: float | None = None) -> int:
        with self._write() as db:
            return self._add_audit(db, actor, action, target, detail, at)

    def audit_log(self, limit: int = 100, before: int | None = None) -> list[AuditRecord]:
        """Audit records, newest first; only ids below `before` when given."""
        if before is None:
            rows = self._conn.execute("SELECT * FROM audit ORDER BY id DESC LIMIT ?", (limit,))
        else:
            rows = self._conn.execute("SELECT * FROM audit WHERE id < ? ORDER BY id DESC "
                                      "LIMIT ?", (before, limit))
        return [_audit(r) for r in rows.fetchall()]


# --------------------------------------------------------------------- the asynchronous store
P = ParamSpec("P")


class _StoreCall(Generic[P, T]):
    """A call of `Store` made from `StoreDB`'s method `fn` (see the table in `Store`)."""

    def __init__(self, fn: Callable[Concatenate[StoreDB, P], T], record: bool) -> None:
        self.fn = fn
        self.record = record
        self.__doc__ = fn.__doc__

    def __get__(self, store: Store, owner: type | None = None) -> Callable[P, Awaitable[T]]:
        method = getattr(store._db, self.fn.__name__)
        if self.record:
            async def record(*args: P.args, **kwargs: P.kwargs) -> T:
                await store._record(method, *args, **kwargs)
                return None  # type: ignore[return-value]  # records return nothing
            return record

        async def query(*args: P.args, **kwargs: P.kwargs) -> T:
            return await store._run(method, *args, **kwargs)
        return query


def _query(fn: Callable[Concatenate[StoreDB, P], T]) -> _StoreCall[P, T]:
    return _StoreCall(fn, record=False)


def _record_call(fn: Callable[Concatenate[StoreDB, P], None]) -> _StoreCall[P, None]:
    return _StoreCall(fn, record=True)


class Store:
    """The daemon's store: every call runs on the store's own thread, one at a time. Records
    (a lease's end, its scrub, an idle-detach event, GPU time, an audit record) go through the
    record spooler (store/replay.py): to the database, or while it is unreachable to the
    record spool in the state directory, written to the database in order once it is back."""

    def __init__(self, db: StoreDB, executor: ThreadPoolExecutor, spool: Spool,
                 spool_executor: ThreadPoolExecutor) -> None:
        self._db = db
        self._executor = executor
        self._spool_executor = spool_executor
        self._closed = False
        self._spooler = RecordSpooler(
            spool, spool_executor, self._run, db.apply_spooled, db.forget_spooled,
            store_errors, refused=lambda exc: isinstance(exc, (NotFound, db._integrity_error)),
            closed=lambda exc: isinstance(exc, StoreClosed))

    @classmethod
    async def open(cls, location: Path | str, password_file: Path | None = None,
                   server: str = "", state_dir: Path | None = None) -> Store:
        """The store in a SQLite file, or in PostgreSQL for a `postgresql://` URL; `server`:
        this server's name (config/identity.py), written into its lease records; `state_dir`:
        where the record spool lives (default: the SQLite file's folder; PostgreSQL needs it).
        Records a previous run left in the spool are written before this returns when the
        database takes them (else as soon as it does)."""
        if state_dir is None:
            if postgres.is_url(location):
                raise ValueError("a PostgreSQL store needs a state directory for its record spool")
            state_dir = Path(location).parent
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpupoold-store")
        spool_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpupoold-spool")
        spool = Spool(state_dir / SPOOL_NAME)
        loop = asyncio.get_running_loop()
        where = location if postgres.is_url(location) else Path(location)
        try:
            db = await loop.run_in_executor(executor, StoreDB, where, password_file, server)
            try:
                await loop.run_in_executor(spool_executor, spool.open)
            except BaseException:
                await loop.run_in_executor(executor, db.close)
                raise
        except BaseException:
            executor.shutdown(wait=False)
            spool_executor.shutdown(wait=False)
            raise
        store = cls(db, executor, spool, spool_executor)
        await store._spooler.start()
        return store

    @property
    def path(self) -> Path | None:
        return self._db.path

    @property
    def where(self) -> str:
        """The SQLite file, or the PostgreSQL URL without any password."""
        return self._db.where

    @property
    def spool_path(self) -> Path:
        return self._spooler.spool.path

    @property
    def spool_bytes(self) -> int:
        """The size of the record spool (0: there is none)."""
        return self._spooler.spool.size

    @property
    def pending(self) -> int:
        """Records in the spool that the database does not have yet."""
        return self._spooler.pending

    async def close(self) -> None:
        """Wait for the calls already made (and try the spooled records once more), then close
        the database; records still spooled stay in the spool for the next start."""
        if self._closed:
            return
        await self._spooler.stop()
        self._closed = True
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._db.close)
        await asyncio.to_thread(self._executor.shutdown, True)
        await asyncio.to_thread(self._spool_executor.shutdown, True)

    async def _run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if self._closed:
            raise StoreClosed("the store is closed")
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor,
                                              functools.partial(fn, *args, **kwargs))
        except RuntimeError as exc:  # submitted after the executor was shut down
            if self._closed:
                raise StoreClosed("the store is closed") from exc
            raise

    async def _record(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Write a record now or, the database unreachable, put it in the spool (on disk when
        this returns), written from there in order once the database is back."""
        if self._closed:
            raise StoreClosed("the store is closed")
        await self._spooler.record(fn, args, kwargs)

    # The calls: each runs StoreDB's method of the same name on the store's thread, with
    # StoreDB's own signature (one source: nothing here repeats a parameter list). A query
    # returns what the database says, or raises; a record is written in order, spooled while
    # the database is unreachable (`_record`).
    create_token = _query(StoreDB.create_token)
    replace_token = _query(StoreDB.replace_token)
    list_tokens = _query(StoreDB.list_tokens)
    get_token = _query(StoreDB.get_token)
    revoke_token = _query(StoreDB.revoke_token)
    set_token_weight = _query(StoreDB.set_token_weight)
    verify_token = _query(StoreDB.verify_token)
    touch_token = _query(StoreDB.touch_token)
    lease_started = _query(StoreDB.lease_started)
    lease_gpus = _query(StoreDB.lease_gpus)
    lease_ended = _record_call(StoreDB.lease_ended)
    lease_scrubbed = _record_call(StoreDB.lease_scrubbed)
    open_leases = _query(StoreDB.open_leases)
    lease_event = _record_call(StoreDB.lease_event)
    lease_events = _query(StoreDB.lease_events)
    unscrubbed_last_leases = _query(StoreDB.unscrubbed_last_leases)
    gpu_states = _query(StoreDB.gpu_states)
    save_gpu_states = _query(StoreDB.save_gpu_states)
    leases = _query(StoreDB.leases)
    get_lease = _query(StoreDB.get_lease)
    server_up = _query(StoreDB.server_up)
    server_heartbeat = _query(StoreDB.server_heartbeat)
    server_down = _query(StoreDB.server_down)
    silent_servers = _query(StoreDB.silent_servers)
    clock = _query(StoreDB.clock)
    servers = _query(StoreDB.servers)
    spread_part = _query(StoreDB.spread_part)
    fleet_sync = _query(StoreDB.fleet_sync)
    fleet_snapshot = _query(StoreDB.fleet_snapshot)
    audit_log = _query(StoreDB.audit_log)
    record_usage = _record_call(StoreDB.record_usage)
    usage_minutes = _query(StoreDB.usage_minutes)
    usage_gpus = _query(StoreDB.usage_gpus)

    @property
    def server(self) -> str:
        return self._db.server

    # The one call with more than StoreDB's: the time of the audit record is taken here, when
    # the action happened, not when a database that was away takes the record.
    async def audit(self, actor: str, action: str, target: str, detail: str = "") -> None:
        await self._record(self._db.audit, actor, action, target, detail, time.time())

