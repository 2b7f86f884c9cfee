"""PostgreSQL under the store (`database = "postgresql://..."`): a psycopg 3 connection that
takes the SQL `StoreDB` writes (SQLite's dialect, kept to what both understand) and answers with
rows that read like `sqlite3.Row`, so that one set of queries and one set of migrations serve
both databases (docs/architecture.md, "Store").

Why psycopg 3: it is PostgreSQL's maintained Python driver with both a blocking and an asyncio
API. The store already runs its calls on a thread of its own (no database call on the event
loop), so the blocking API keeps one code path for both databases; LISTEN/NOTIFY, which the
fleet needs for revocations, is available in the same library. It is imported only when a
PostgreSQL URL is configured, so a single box on SQLite needs none of it.

Differences that are translated here, not written twice:
- placeholders: `?` becomes `%s` (and a literal `%` is doubled);
- Python bools become 0/1 (the schema's flags are integers in both databases);
- DDL (`ddl`): `INTEGER PRIMARY KEY AUTOINCREMENT` becomes an identity column, `INTEGER` is
  `BIGINT` (SQLite's INTEGER is 64-bit) and `REAL` is `DOUBLE PRECISION`.
Passwords never come from the URL (it is in the config file): psycopg reads PGPASSWORD or the
PGPASSFILE file from the environment, or gpupoold passes the first line of
`database_password_file`.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

SCHEMES = ("postgresql://", "postgres://")
CONNECT_TIMEOUT_S = 10
# A dead link (a partition: nothing answers, nothing is refused) must end in an error, not hang
# the store's thread until TCP gives up (about 15 minutes): a request sent and not acknowledged
# within 10 s (tcp_user_timeout), or a reply awaited with the peer silent to keepalive probes
# (5 s idle, then 3 probes 2 s apart), breaks the connection; the next call connects again.
LINK_TIMEOUTS: dict[str, int] = {"keepalives": 1, "keepalives_idle": 5,
                                 "keepalives_interval": 2, "keepalives_count": 3,
                                 "tcp_user_timeout": 10_000}
# And on PostgreSQL's side: a session left idle inside a transaction for this long (its server
# cut off in the middle of a fleet sync, holding the fleet's lock) is ended by PostgreSQL, and
# the lock with it, so the others go on (store/fleet.py). The store's transactions are a few
# statements in a row, milliseconds apart.
IDLE_IN_TRANSACTION_S = 10


class UrlError(ValueError):
    """A database URL that cannot be used; the message says what to change."""


def driver_errors() -> tuple[type[BaseException], ...]:
    """psycopg's base error, for callers that catch database errors of either kind (empty when
    psycopg is not installed: then no PostgreSQL store exists to raise one)."""
    try:
        import psycopg
    except ImportError:
        return ()
    return (psycopg.Error,)


def is_url(location: object) -> bool:
    return isinstance(location, str) and location.startswith(SCHEMES)


def check_url(url: str) -> None:
    """Refuse a URL that carries its password (config files are readable by more people than
    a secret should be) or that names no database."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is not None:
        raise UrlError("the database URL holds a password: remove it from the URL and give it in "
                       "the environment (PGPASSWORD, or a PGPASSFILE file) or in the file named "
                       "by the setting 'database_password_file'")
    if not parts.path.strip("/") and "dbname=" not in parts.query:
        raise UrlError(f"the database URL {redacted(url)} names no database: write "
                       "postgresql://USER@HOST:PORT/DATABASE")


def _local_host(host: str) -> bool:
    """A libpq host that stays on this machine: empty (the default Unix socket), a socket
    directory (`/...`, `@abstract`), `localhost` or a loopback address."""
    import ipaddress

    host = host.strip().strip("[]")
    if not host or host.startswith(("/", "@")) or host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def url_hosts(url: str, environ: Mapping[str, str] | None = None) -> list[str]:
    """The hosts a libpq URL connects to: those of its authority (`host1,host2:port`), else its
    `host=` parameter, else $PGHOST; [''] for the default Unix socket."""
    env = os.environ if environ is None else environ
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]
    query = urllib.parse.parse_qs(parts.query)
    text = urllib.parse.unquote(netloc)
    hosts = []
    for item in text.split(","):
        item = item.strip()
        if item.startswith("["):
            hosts.append(item[1:item.find("]")] if "]" in item else item[1:])
        else:
            hosts.append(item.rpartition(":")[0] if item.count(":") == 1 else item)
    if not any(hosts):
        given = query.get("host", [env.get("PGHOST", "")])[-1]
        hosts = [h.strip() for h in given.split(",")]
    return hosts or [""]


def link_problem(url: str, insecure: bool, environ: Mapping[str, str] | None = None
                 ) -> str | None:
    """Why the link to the database at `url` is not safe enough to start with, or None: a host
    that is not loopback nor a Unix socket needs `sslmode=verify-full` (libpq's default `prefer`
    falls back to clear text, and `require` accepts any certificate), unless `insecure`
    (`database_insecure = true`, warned by the caller)."""
    env = os.environ if environ is None else environ
    remote = [h for h in url_hosts(url, env) if not _local_host(h)]
    if not remote:
        return None
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)
    sslmode = query.get("sslmode", [env.get("PGSSLMODE", "")])[-1]
    if sslmode == "verify-full" or insecure:
        return None
    now = f"sslmode={sslmode}" if sslmode else "no sslmode (libpq's default, prefer)"
    return (f"setting 'database': the PostgreSQL at {', '.join(remote)} is on another host and "
            f"{redacted(url)} has {now}: anyone on that link could read or change tokens and "
            f"lease records. Add `sslmode=verify-full&sslrootcert=/path/to/ca.crt` to the URL's "
            f"query (the server's certificate must name that host), or set "
            f"`database_insecure = true` to accept it (warned at every start)")


def link_parameters(url: str) -> dict[str, Any]:
    """libpq parameters that bound how long a dead link can hold a call (LINK_TIMEOUTS,
    IDLE_IN_TRANSACTION_S), each unless the URL sets it: the URL's `options` keep theirs."""
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)
    out: dict[str, Any] = {k: v for k, v in LINK_TIMEOUTS.items() if k not in query}
    idle = f"-c idle_in_transaction_session_timeout={IDLE_IN_TRANSACTION_S * 1000}"
    given = query.get("options", [""])[-1]
    if "idle_in_transaction_session_timeout" not in given:
        out["options"] = f"{given} {idle}".strip()
    return out


def redacted(url: str) -> str:
    """The URL as logs may show it (without any password)."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def ddl(sql: str) -> str:
    """A CREATE/ALTER statement of the store's migrations in PostgreSQL's types."""
    sql = sql.replace("INTEGER PRIMARY KEY AUTOINCREMENT",
                      "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY")
    sql = re.sub(r"\bINTEGER\b", "BIGINT", sql)
    return re.sub(r"\bREAL\b", "DOUBLE PRECISION", sql)


class Row:
    """A result row read by position, by column name or as a sequence, as sqlite3.Row is."""

    __slots__ = ("_index", "_values")

    def __init__(self, index: dict[str, int], values: Sequence[Any]) -> None:
        self._index = index
        self._values = values

    def __getitem__(self, key: int | str) -> Any:
        return self._values[key if isinstance(key, int) else self._index[key]]

    def __iter__(self):  # noqa: ANN204 - an iterator of the values
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def keys(self) -> list[str]:
        return list(self._index)


def _row_factory(cursor: Any) -> Any:
    index = {col.name: i for i, col in enumerate(cursor.description or ())}
    return lambda values: Row(index, values)


class PgConnection:
    """What StoreDB uses of a sqlite3 connection: execute() returning a cursor, close()."""

    def __init__(self, url: str, password_file: Path | None = None) -> None:
        try:
            import psycopg  # only here: SQLite users need not install it
        except ImportError:
            raise UrlError("a postgresql:// database needs the psycopg driver, which is not "
                           "installed: pip install 'gpupoold[postgresql]' (or unset 'database' "
                           "to keep the records in SQLite)") from None
        check_url(url)
        kwargs: dict[str, Any] = {}
        if password_file is not None:
            try:
                kwargs["password"] = password_file.read_text().splitlines()[0].strip()
            except (OSError, IndexError) as exc:
                raise UrlError(f"cannot read the database password from {password_file} (setting "
                               f"'database_password_file'): {exc}") from exc
        self.integrity_error: type[Exception] = psycopg.IntegrityError
        self._url = url
        self._kwargs = kwargs
        try:
            self._conn = self._connect()
        except psycopg.OperationalError as exc:
            raise UrlError(f"cannot connect to the database {redacted(url)}: "
                           f"{str(exc).strip() or type(exc).__name__}") from exc

    def _connect(self) -> Any:
        import psycopg
        return psycopg.connect(self._url, autocommit=True, row_factory=_row_factory,
                               connect_timeout=CONNECT_TIMEOUT_S,
                               **link_parameters(self._url), **self._kwargs)

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        values = tuple(int(p) if isinstance(p, bool) else p for p in params)
        if self._conn.closed or self._conn.broken:
            # The server restarted or the network dropped the connection: a new one, here, so
            # that the daemon recovers by itself when the database is back (this raises while
            # it is not).
            self._conn = self._connect()
        cur = self._conn.cursor()
        cur.execute(sql.replace("%", "%%").replace("?", "%s") if values else sql, values or None)
        return cur

    @property
    def raw(self) -> Any:
        """The psycopg connection itself (store/notify.py waits on its notifications)."""
        return self._conn

    def close(self) -> None:
        self._conn.close()
