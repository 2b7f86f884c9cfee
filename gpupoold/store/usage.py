"""The store's usage rows (issue 33; schema v9 and v10 in store/database.py): adding what the GPU time
accounting (pool/usage.py) accumulated, and reading it back for the report. A mixin of
`StoreDB` (its connection, write transactions and server name), kept apart so that the store's
main module stays readable; the same SQL serves SQLite and PostgreSQL.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class UsageMinute(Protocol):
    """A GPU's leased and busy seconds in one minute for one token (pool/usage.py's
    MinuteUsage; described here, as the store sits below the pool)."""

    @property
    def gpu(self) -> int: ...
    @property
    def minute(self) -> float: ...
    @property
    def token(self) -> str: ...
    @property
    def leased_s(self) -> float: ...
    @property
    def busy_s(self) -> float: ...
    @property
    def reused_s(self) -> float: ...


class LeaseSeconds(Protocol):
    @property
    def leased_s(self) -> float: ...
    @property
    def busy_s(self) -> float: ...
    @property
    def reused_s(self) -> float: ...


class UsageRecords(Protocol):
    """What accumulated to be added (pool/usage.py's UsageDelta)."""

    @property
    def minutes(self) -> Sequence[UsageMinute]: ...
    @property
    def leases(self) -> Mapping[int, LeaseSeconds]: ...


@dataclass(frozen=True)
class _Minute:
    gpu: int
    minute: float
    token: str
    leased_s: float
    busy_s: float
    reused_s: float


@dataclass(frozen=True)
class _Seconds:
    leased_s: float
    busy_s: float
    reused_s: float


@dataclass(frozen=True)
class StoredUsage:
    """A usage delta read back from the record spool (store/spool.py)."""

    minutes: list[_Minute]
    leases: dict[int, _Seconds]


_SECONDS = ("leased_s", "busy_s", "reused_s")


def usage_to_json(delta: UsageRecords) -> dict[str, Any]:
    """A usage delta as JSON values, for the record spool (`usage_from_json` reads it back)."""
    return {"minutes": [{"gpu": m.gpu, "minute": m.minute, "token": m.token,
                         **{k: getattr(m, k) for k in _SECONDS}} for m in delta.minutes],
            "leases": [[lease_id, *(getattr(u, k) for k in _SECONDS)]
                       for lease_id, u in sorted(delta.leases.items())]}


def usage_from_json(obj: Mapping[str, Any]) -> StoredUsage:
    return StoredUsage(
        minutes=[_Minute(int(m["gpu"]), float(m["minute"]), str(m["token"]),
                         *(float(m[k]) for k in _SECONDS)) for m in obj["minutes"]],
        leases={int(row[0]): _Seconds(*map(float, row[1:4])) for row in obj["leases"]})


class UsageQueries:
    """The usage calls of StoreDB (which provides `_conn`, `_write` and `server`)."""

    _conn: Any
    server: str

    def _write(self) -> contextlib.AbstractContextManager[Any]:
        raise NotImplementedError

    def record_usage(self, delta: UsageRecords, prune_before: float | None = None) -> None:
        """Add a usage delta (pool/usage.py) to this server's per-minute rows and the leases'
        totals, in one transaction; drop minute rows older than `prune_before` (retention)."""
        with self._write() as db:
            for row in delta.minutes:
                db.execute(
                    "INSERT INTO gpu_usage (server, gpu_index, minute, token, leased_s, busy_s, "
                    "reused_s) VALUES (?, ?, ?, ?, ?, ?, ?) "
                    "ON CONFLICT (server, gpu_index, minute, token) "
                    "DO UPDATE SET leased_s = gpu_usage.leased_s + excluded.leased_s, "
                    "busy_s = gpu_usage.busy_s + excluded.busy_s, "
                    "reused_s = gpu_usage.reused_s + excluded.reused_s",
                    (self.server, row.gpu, row.minute, row.token, row.leased_s, row.busy_s,
                     row.reused_s))
            for lease_id, usage in sorted(delta.leases.items()):
                db.execute("UPDATE leases SET leased_s = leased_s + ?, busy_s = busy_s + ?, "
                           "reused_s = reused_s + ? WHERE id = ?",
                           (usage.leased_s, usage.busy_s, usage.reused_s, lease_id))
            if prune_before is not None:
                db.execute("DELETE FROM gpu_usage WHERE minute < ?", (prune_before,))

    def usage_minutes(self, since: float, until: float) -> list[dict[str, Any]]:
        """The per-minute rows of every server with `since` <= minute < `until`."""
        rows = self._conn.execute(
            "SELECT server, gpu_index, minute, token, leased_s, busy_s, reused_s FROM gpu_usage "
            "WHERE minute >= ? AND minute < ? ORDER BY minute, server, gpu_index, token",
            (since, until))
        return [{"server": r["server"], "gpu": r["gpu_index"], "minute": r["minute"],
                 "token": r["token"], "leased_s": r["leased_s"], "busy_s": r["busy_s"],
                 "reused_s": r["reused_s"]}
                for r in rows.fetchall()]

    def usage_gpus(self) -> list[tuple[str, int]]:
        """(server, GPU index) of every GPU the fleet table knows (a shared store)."""
        rows = self._conn.execute("SELECT server, gpu_index FROM fleet_gpus "
                                  "ORDER BY server, gpu_index")
        return [(r["server"], r["gpu_index"]) for r in rows.fetchall()]
