"""Records that wait for the database (issue 34, item 4): the store's side of the record spool
(store/spool.py holds its file format).

- `RecordSpooler`, which the daemon's `Store` (store/database.py) hands every record to (a
  lease's end, its scrub, an idle-detach event, GPU time, an audit record): it writes it to the
  database or, the database unreachable, to the spool, on disk before the call returns; from
  then on the records after it follow it there, so that they reach the database in the order
  they were made. A retry loop, and the next start, replays the spool in order and removes it
  once every record in it is committed.
- `SpoolQueries`, a mixin of `StoreDB`: writes one spooled record together with its id in one
  transaction, so that a replay that runs twice (gpupoold killed between the database's
  commit and the spool's removal) writes each record once.

The spooler's file I/O (append with fsync, read, remove) runs on a thread of its own: the
store's thread may be stuck on an unreachable database for as long as a connection attempt
takes, and a record must reach the disk meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from gpupoold.store.spool import Spool, SpooledRecord
from gpupoold.store.tokens import format_utc
from gpupoold.store.usage import usage_from_json, usage_to_json

PENDING_RETRY_S = 1.0  # how often the spool's records are tried again during an outage
# The calls of `Store` that are records (written later when the database is away), by name.
SPOOLED_CALLS = frozenset({"lease_ended", "lease_scrubbed", "lease_event", "record_usage",
                           "audit"})

T = TypeVar("T")
log = logging.getLogger("gpupoold.store")


def why(exc: BaseException) -> str:
    return str(exc).strip() or type(exc).__name__


class SpoolQueries:
    """The spool calls of StoreDB (which provides `_conn`, `_write` and `server`; a call made
    inside `_write`'s transaction joins it)."""

    _conn: Any
    server: str

    def _write(self) -> contextlib.AbstractContextManager[Any]:
        raise NotImplementedError

    def apply_spooled(self, record: SpooledRecord) -> bool:
        """Write a record from the spool and note its id, in one transaction; False when its
        id is noted already (a second replay of it: nothing is written)."""
        if record.call not in SPOOLED_CALLS:  # not retried: no later try would know it either
            raise ValueError(f"the spool holds a record of an unknown call {record.call!r}")
        args, kwargs = list(record.args), dict(record.kwargs)
        if record.call == "record_usage":  # its delta was spooled as JSON (usage_to_json)
            if args:
                args[0] = usage_from_json(args[0])
            else:
                kwargs["delta"] = usage_from_json(kwargs["delta"])
        with self._write() as db:
            if db.execute("INSERT INTO spool_applied (id, server, applied) VALUES (?, ?, ?) "
                          "ON CONFLICT (id) DO NOTHING",
                          (record.id, self.server, time.time())).rowcount != 1:
                return False
            getattr(self, record.call)(*args, **kwargs)  # joins this transaction
        return True

    def forget_spooled(self, ids: Collection[str]) -> None:
        """Drop the notes of records replayed from a spool that is gone (no replay can repeat
        them any more)."""
        chunk = list(ids)
        with self._write() as db:
            for i in range(0, len(chunk), 500):
                part = chunk[i:i + 500]
                db.execute(f"DELETE FROM spool_applied WHERE id IN ({', '.join('?' * len(part))})",
                           part)


class RecordSpooler:
    """Between the daemon's records and the database: writes them, or spools them while the
    database is unreachable, and replays the spool once it is back.

    `run(fn, *args)`: run a StoreDB call on the store's thread (raises StoreClosed once the
    store is closed); `apply` / `forget`: StoreDB's `apply_spooled` / `forget_spooled`;
    `errors()`: what a store call raises when the database cannot be used; `refused(exc)`: of
    those, the ones that mean the database answered and refused the record (retrying would not
    help); `closed(exc)`: the store is closed."""

    def __init__(self, spool: Spool, executor: ThreadPoolExecutor,
                 run: Callable[..., Awaitable[Any]],
                 apply: Callable[[SpooledRecord], bool], forget: Callable[[Collection[str]], None],
                 errors: Callable[[], tuple[type[BaseException], ...]],
                 refused: Callable[[BaseException], bool],
                 closed: Callable[[BaseException], bool]) -> None:
        self.spool = spool
        self._executor = executor
        self._run = run
        self._apply = apply
        self._forget = forget
        self._errors = errors
        self._refused = refused
        self._closed = closed
        self.spooling = spool.records > 0  # records go to the spool until it is replayed
        self._order = asyncio.Lock()  # records are written or spooled one at a time, in order
        self._replayed_to = 0  # the spool's offset up to which the database has the records
        self._replayed: list[str] = []  # the ids of those records
        self._counts = {"written": 0, "again": 0, "refused": 0, "damaged": 0}
        self._flusher: asyncio.Task[None] | None = None
        self._stopped = False

    @property
    def pending(self) -> int:
        """Records in the spool that the database does not have yet."""
        return max(0, self.spool.records - len(self._replayed)) if self.spooling else 0

    async def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def start(self) -> None:
        """At the store's opening: the records a previous run left are written now when the
        database takes them (else by the retry loop)."""
        if not self.spooling:
            return
        log.warning("the record spool %s holds %d record(s) from a previous run (the "
                    "database was unreachable then): writing them to the database",
                    self.spool.path, self.spool.records)
        try:
            await self.replay()
        except self._errors() as exc:
            log.error("the store cannot take the spooled records yet (%s): tried again "
                      "every %g s", why(exc), PENDING_RETRY_S)
            self._start_flusher()

    async def record(self, fn: Callable[..., Any], args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> None:
        """Write a record now or, the database unreachable, put it in the spool: it is on disk
        when this returns, and written from there in order once the database is back."""
        async with self._order:
            if not self.spooling:
                try:
                    await self._run(fn, *args, **kwargs)
                    return
                except self._errors() as exc:
                    if self._closed(exc):
                        raise
                    if self._refused(exc):
                        log.error("the store refused the record %s%s: %s", fn.__name__,
                                  args[:2], why(exc))
                        return
                    # Once per outage: the records after this one follow it into the spool.
                    log.error("the store cannot be reached (%s): records are written to the "
                              "spool %s until it is back, then to the database", why(exc),
                              self.spool.path)
                    self.spooling = True
            await self._put(fn.__name__, args, kwargs)
        self._start_flusher()

    async def _put(self, call: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        values, named = list(args), dict(kwargs)
        if call == "record_usage":  # a usage delta (pool/usage.py) as JSON values
            if values:
                values[0] = usage_to_json(values[0])
            else:
                named["delta"] = usage_to_json(named["delta"])
        record = SpooledRecord.new(call, values, named)
        try:
            await self._in_thread(self.spool.append, record)
        except OSError as exc:
            log.error("cannot write the record spool %s (%s): this record is lost: %s; make "
                      "room in the state directory, or make it writable for gpupoold",
                      self.spool.path, why(exc), record.line().decode().strip())

    def _start_flusher(self) -> None:
        if self.spooling and not self._stopped and (self._flusher is None
                                                    or self._flusher.done()):
            self._flusher = asyncio.create_task(self._flush(), name="store-spool")

    async def _flush(self) -> None:
        while self.spooling and not self._stopped:
            await asyncio.sleep(PENDING_RETRY_S)
            with contextlib.suppress(*self._errors()):
                await self.replay()

    async def replay(self) -> None:
        """Write the spool's records to the database in order, each with its id in one
        transaction, then remove the spool. Raises what the store raises while the database is
        unreachable; the next try goes on from there."""
        while True:
            got = await self._in_thread(self.spool.read, self._replayed_to)
            self._counts["damaged"] += got.skipped
            for record, end in got.records:
                try:
                    taken = await self._run(self._apply, record)
                    self._counts["written" if taken else "again"] += 1
                except self._errors() as exc:
                    if not self._refused(exc):
                        raise
                    self._counts["refused"] += 1
                    log.error("the spooled record %s%s (made at %s) was refused by the "
                              "database: dropped: %s", record.call, tuple(record.args[:2]),
                              format_utc(record.at), why(exc))
                except Exception:  # a record the database refuses for itself: not retried
                    self._counts["refused"] += 1
                    log.exception("the spooled record %s%s (made at %s) could not be written: "
                                  "dropped", record.call, tuple(record.args[:2]),
                                  format_utc(record.at))
                self._replayed.append(record.id)
                self._replayed_to = end
            self._replayed_to = max(self._replayed_to, got.end)
            async with self._order:  # no record is spooled meanwhile
                if self._replayed_to < self.spool.size:
                    continue  # records came while these were written: them too
                await self._in_thread(self.spool.remove)
                self.spooling = False
                ids, self._replayed, self._replayed_to = self._replayed, [], 0
                counts, self._counts = self._counts, dict.fromkeys(self._counts, 0)
            break
        log.warning("the store is reachable again: %d record(s) written from the spool %s "
                    "(%d it had already, %d refused, %d damaged), spool removed",
                    counts["written"], self.spool.path, counts["again"], counts["refused"],
                    counts["damaged"])
        try:  # the notes of those ids: no replay can repeat them now
            await self._run(self._forget, ids)
        except self._errors() as exc:
            log.info("the notes of %d replayed record(s) stay in the database (%s)", len(ids),
                     why(exc))

    async def stop(self) -> None:
        """Before the store closes: the records made before this are written or spooled, the
        spool tried once more; what is still spooled stays for the next start."""
        self._stopped = True
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(BaseException):
                await self._flusher
        async with self._order:
            pass
        if self.spooling:
            with contextlib.suppress(*self._errors()):
                await self.replay()
        if self.spooling:
            log.warning("the store closes with %d record(s) in the spool %s (the database is "
                        "unreachable): they are written at the next start", self.pending,
                        self.spool.path)
