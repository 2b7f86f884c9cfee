"""The fleet's shared state in the store (PostgreSQL): every server's GPUs (`fleet_gpus`) and
the one queue of clients waiting for a GPU anywhere (`fleet_queue`), read and changed only inside
`sync`, which holds a transaction-scoped advisory lock for the whole transaction.

That lock is the fleet's single point of order: two servers never decide at once, so a GPU row is
given to at most one ticket (`holder`), tickets are served in their order (they come from one
sequence), and what one server decided is what the next one reads. The decisions themselves are
the pool's (pool/fleet.py passes `match` in); this module only moves rows.

A GPU row belongs to its server: only it writes `state`/`free` and clears `holder` (when the
lease or reservation for that ticket is over). A queue row belongs to the server the client waits
on until a GPU is assigned to it; then to the GPU's server, which deletes it once it is done with
it. Rows of servers marked down are dropped here, so nobody waits for them. Each server also
replaces its rows of `fleet_away` at each sync: its leases off a GPU, which count toward their
token's `max_gpus_per_token` like the GPUs it holds.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

FLEET_LOCK = 7070708  # pg_advisory_xact_lock key (the migrations use 7070707)
# NOTIFY channel: "something changed for you, look again"; the payload names the servers concerned
# (space-separated; empty: every server), so that one grant wakes the two servers it concerns, not
# the whole fleet (bench/fleet_scale.py: with a NOTIFY for all, every event cost a locked sync of
# every server, and 50 servers spent their time waiting for the lock)
CHANNEL = "gpupool_fleet"


@dataclass(frozen=True)
class GpuRow:
    """One GPU of the fleet as its server last wrote it."""

    server: str
    index: int
    uuid: str
    name: str
    memory_total: int
    simulated: bool
    state: str  # the slot's state on its server (free, leased, scrubbing, ...)
    free: bool  # its server would give it to a waiter now
    lease_id: int | None
    token: str  # the lease's token name ("" when none)
    updated: float
    holder: int | None = None  # the ticket it is assigned or reserved to
    holder_token: str = ""


@dataclass(frozen=True)
class QueueRow:
    ticket: int
    server: str  # where the client waits
    token: str
    client: dict[str, Any]
    request: dict[str, Any]  # Requirements fields: gpu, model, min_memory
    only: tuple[int, ...] | None  # GPU indexes of its own server it may take (None: any)
    redirectable: bool  # may be sent to another server (False: its own server's GPUs only)
    joined: float
    state: str  # waiting | assigned | gone
    assigned_server: str | None = None
    assigned_gpu: int | None = None  # the first of `assigned_gpus`
    # How many GPUs the client asks for, all at once from one server (GPUPOOL_GPUS; schema v14),
    # and those `match` gave it there, in its program's order (() while it waits).
    gpus: int = 1
    assigned_gpus: tuple[int, ...] = ()
    # A client that takes its GPUs from several servers when no one server has them all
    # (GP_HELLO_SPREAD, protocol 1.8; schema v17), and the parts `match` gave it: (server, its
    # GPU indexes) in the program's device order, its own server's first (() while it waits, and
    # for a lease of one server: `assigned_server`/`assigned_gpus` say it, and a spread ticket
    # that one server could serve whole is such a lease: no parts). The ticket is the parts'
    # `spread_group`.
    spread: bool = False
    parts: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # Only in a new waiter's row, never stored: the hello of part `claim[1]` of `claim[2]` parts
    # of the spread lease `claim[0]` (its ticket), which takes that ticket back here or is
    # refused (SyncResult).
    claim: tuple[int, int, int] | None = None

    def part_here(self, server: str) -> tuple[int, ...]:
        """The GPU indexes of `server` this assigned row was given (a spread lease's part
        there, or the GPUs of a lease of one server when that is `server`)."""
        if self.parts:
            return next((gpus for there, gpus in self.parts if there == server), ())
        return self.assigned_gpus if self.assigned_server == server else ()


@dataclass
class SyncInput:
    """What one server brings to a sync: its GPUs now, and what happened to its waiters."""

    server: str
    gpus: list[GpuRow]
    new_waiters: list[tuple[int, QueueRow]]  # (local key, row without ticket)
    gone: list[int] = field(default_factory=list)  # its waiters' tickets whose clients left
    finished: list[int] = field(default_factory=list)  # tickets its GPUs are done with
    unassign: list[int] = field(default_factory=list)  # assignments it could not use: requeue
    # its leases off a GPU (detached, or called back and not seated yet), as (lease id, token):
    # they count toward their token's max_gpus_per_token (pool/fleet.py's `match`)
    away: list[tuple[int, str]] = field(default_factory=list)
    # how many GPUs each of those leases holds (a lease of several: all of them count), by lease
    # id; a lease not named holds one
    away_gpus: dict[int, int] = field(default_factory=dict)


@dataclass
class SyncResult:
    tickets: dict[int, int]  # local key -> ticket of the new waiters
    gpus: list[GpuRow]  # the whole fleet, holders included
    queue: list[QueueRow]  # the whole fleet queue, in ticket order
    servers: dict[str, dict[str, Any]]  # name -> {"remoting", "state", ...}
    assigned: list[tuple[int, str, int]]  # (ticket, server, gpu index) decided in this sync
    # every live server's leases off a GPU, as (server, token), once per GPU each holds
    away: list[tuple[str, str]] = field(default_factory=list)
    # New waiters that were the hello of a spread lease's part and found no part of theirs held
    # here (local key -> why): they are refused, not queued (pool/fleet.py)
    unclaimed: dict[int, str] = field(default_factory=dict)


# match(gpus, queue, up servers, leases off a GPU by token) -> [(ticket, server, gpu index)]
Matcher = Callable[[Sequence[GpuRow], Sequence[QueueRow], set[str], Counter[str]],
                   list[tuple[int, str, int]]]


def _gpu(r: Any) -> GpuRow:
    return GpuRow(server=r["server"], index=int(r["gpu_index"]), uuid=r["uuid"], name=r["name"],
                  memory_total=int(r["memory_total"]), simulated=bool(r["simulated"]),
                  state=r["state"], free=bool(r["free"]), lease_id=r["lease_id"],
                  token=r["token"], updated=float(r["updated"]), holder=r["holder"],
                  holder_token=r["holder_token"])


def _waiter(r: Any) -> QueueRow:
    only = json.loads(r["only_gpus"]) if r["only_gpus"] else None
    return QueueRow(ticket=int(r["ticket"]), server=r["server"], token=r["token"],
                    client=json.loads(r["client"]), request=json.loads(r["request"]),
                    only=tuple(only) if only is not None else None,
                    redirectable=bool(r["redirectable"]), joined=float(r["joined"]),
                    state=r["state"], assigned_server=r["assigned_server"],
                    assigned_gpu=r["assigned_gpu"], gpus=int(r["gpus"] or 1),
                    assigned_gpus=tuple(json.loads(r["assigned_gpus"] or "[]")),
                    spread=bool(r["spread"]),
                    parts=tuple((str(server), tuple(int(i) for i in gpus))
                                for server, gpus in json.loads(r["assigned_parts"] or "[]")))


def _in(values: Sequence[int]) -> str:
    return "(" + ", ".join("?" for _ in values) + ")"


def _by_ticket(assigned: Sequence[tuple[int, str, int]],
               spread: Collection[int] = ()) -> dict[int, list[tuple[str, list[int]]]]:
    """`match`'s assignments by ticket: its parts, (server, its GPU indexes in order), in the
    order `match` gave them (the program's device order). A lease comes from one server unless
    its client asked to spread it (`spread`: those tickets), so any other ticket given GPUs of two
    servers is a bug of the match, refused before anything is written."""
    out: dict[int, list[tuple[str, list[int]]]] = {}
    for ticket, server, index in assigned:
        parts = out.setdefault(ticket, [])
        part = next((p for p in parts if p[0] == server), None)
        if part is None:
            if parts and ticket not in spread:
                raise ValueError(f"the fleet's match gave ticket {ticket} GPUs of two servers "
                                 f"({parts[0][0]} and {server}); a lease comes from one server "
                                 "unless its client asked to spread it")
            part = (server, [])
            parts.append(part)
        part[1].append(index)
    return out


def _claim_refusal(row: QueueRow | None, w: QueueRow, me: str) -> str | None:
    """Why the hello of a spread lease's part (`w`, its `claim`) may not take the GPUs held for
    it on server `me` (None: it may). The client's connect fails with this text."""
    assert w.claim is not None
    group, part, parts = w.claim
    what = f"part {part} of the spread lease {group}"
    gone = (f"{what} is no longer held on server {me} (a part was not claimed within its hold "
            "time, or its server went down, and every part was let go); run the program again")
    if row is None or row.state != "assigned" or not row.parts:
        return gone
    if not 0 <= part < len(row.parts):
        return f"{what}: that lease has {len(row.parts)} parts (0 to {len(row.parts) - 1})"
    if parts != len(row.parts):
        return (f"{what}: that lease has {len(row.parts)} parts, and this hello says {parts}: "
                "a part's hello says the parts its redirect named")
    if row.parts[part][0] != me:
        return f"{what} is held on server {row.parts[part][0]}, not on this one ({me})"
    c = row.client
    if (row.token, c.get("host"), c.get("pid")) != (w.token, w.client.get("host"),
                                                    w.client.get("pid")):
        return (f"{what} is held for another client (not this token, host and pid): a part is "
                "claimed by the process its lease was given to")
    if w.gpus != len(row.parts[part][1]):
        return (f"{what} holds {len(row.parts[part][1])} GPUs on server {me}, and this hello "
                f"asks for {w.gpus}")
    return None


def sync(db: Any, inp: SyncInput, match: Matcher, insert: Callable[..., int],
         now: float) -> SyncResult:
    """One server's turn, inside the caller's transaction (`insert`: StoreDB._insert)."""
    db.execute("SELECT pg_advisory_xact_lock(?)", (FLEET_LOCK,))
    me = inp.server
    concerned: set[str] = set()  # the other servers this turn concerns (NOTIFY, at the end)
    for g in inp.gpus:
        db.execute(
            "INSERT INTO fleet_gpus (server, gpu_index, uuid, name, memory_total, simulated, "
            "state, free, lease_id, token, updated) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (server, gpu_index) DO UPDATE SET uuid = excluded.uuid, "
            "name = excluded.name, memory_total = excluded.memory_total, "
            "simulated = excluded.simulated, state = excluded.state, free = excluded.free, "
            "lease_id = excluded.lease_id, token = excluded.token, updated = excluded.updated",
            (me, g.index, g.uuid, g.name, g.memory_total, g.simulated, g.state, g.free,
             g.lease_id, g.token, now))
    db.execute("DELETE FROM fleet_away WHERE server = ?", (me,))
    for lease_id, token in inp.away:
        db.execute("INSERT INTO fleet_away (server, lease_id, token, gpus) VALUES (?, ?, ?, ?)",
                   (me, lease_id, token, max(1, inp.away_gpus.get(lease_id, 1))))
    if inp.finished:
        # A spread lease's other parts' servers: a part let go here (never claimed) ends the
        # ticket, and they let their held parts go at once rather than at their own deadline.
        for r in db.execute(f"SELECT assigned_parts FROM fleet_queue WHERE ticket IN "
                            f"{_in(inp.finished)} AND assigned_parts IS NOT NULL",
                            tuple(inp.finished)).fetchall():
            concerned.update(server for server, _ in json.loads(r["assigned_parts"] or "[]"))
        db.execute(f"UPDATE fleet_gpus SET holder = NULL, holder_token = '' WHERE server = ? "
                   f"AND holder IN {_in(inp.finished)}", (me, *inp.finished))
        db.execute(f"DELETE FROM fleet_queue WHERE ticket IN {_in(inp.finished)}",
                   tuple(inp.finished))
    # The other servers this turn concerns: they hold a GPU for a ticket, or their waiter got one.
    if inp.unassign:
        concerned.update(r["server"] for r in db.execute(
            f"SELECT server FROM fleet_gpus WHERE holder IN {_in(inp.unassign)}",
            tuple(inp.unassign)).fetchall())
        db.execute(f"UPDATE fleet_gpus SET holder = NULL, holder_token = '' "
                   f"WHERE holder IN {_in(inp.unassign)}", tuple(inp.unassign))
        db.execute(f"UPDATE fleet_queue SET state = 'waiting', assigned_server = NULL, "
                   f"assigned_gpu = NULL, assigned_gpus = NULL, assigned_parts = NULL WHERE state = 'assigned' AND "
                   f"ticket IN {_in(inp.unassign)}", tuple(inp.unassign))
    if inp.gone:  # (a spread lease's every part's server lets its part go)
        for r in db.execute(f"SELECT assigned_server, assigned_parts FROM fleet_queue WHERE "
                            f"state = 'assigned' AND ticket IN {_in(inp.gone)}",
                            tuple(inp.gone)).fetchall():
            concerned.add(r["assigned_server"])
            concerned.update(server for server, _ in json.loads(r["assigned_parts"] or "[]"))
        db.execute(f"DELETE FROM fleet_queue WHERE state = 'waiting' AND ticket IN "
                   f"{_in(inp.gone)}", tuple(inp.gone))
        db.execute(f"UPDATE fleet_queue SET state = 'gone' WHERE ticket IN {_in(inp.gone)}",
                   tuple(inp.gone))
    # A client redirected here: its hello carries no ticket, but the same token, host and pid
    # as a ticket assigned to a GPU of this server. It gets that ticket back (and that GPU),
    # rather than a new one at the end of the queue. One sent to another server's GPU that says
    # its hello here instead gave up on reaching it (its connect timeout ran out, or that
    # server refused it): that ticket is gone, so the GPU held for it there is free at once
    # rather than after the hold's 2 s (pool/fleet.py, REDIRECT_CLAIM_S). A spread ticket that
    # one server serves whole has no parts and is sent (or granted) exactly so; a ticket with
    # parts is claimed by its parts' hellos instead (`claim`).
    sent_here: dict[tuple[str, Any, Any], int] = {}
    sent_away: dict[tuple[str, Any, Any], int] = {}
    away_at: dict[int, str] = {}  # ticket -> the server holding a GPU for it
    if inp.new_waiters:
        for r in db.execute("SELECT ticket, token, client, assigned_server FROM fleet_queue "
                            "WHERE state = 'assigned' AND server <> assigned_server AND "
                            "assigned_parts IS NULL ORDER BY ticket").fetchall():
            c = json.loads(r["client"])
            there = sent_here if r["assigned_server"] == me else sent_away
            there.setdefault((r["token"], c.get("host"), c.get("pid")), int(r["ticket"]))
            away_at[int(r["ticket"])] = r["assigned_server"]
    tickets = {}
    unclaimed: dict[int, str] = {}
    gave_up = []
    for key, w in inp.new_waiters:
        if w.claim is not None:  # a spread lease's part: the ticket held for it, or refused
            r = db.execute("SELECT * FROM fleet_queue WHERE ticket = ?",
                           (w.claim[0],)).fetchone()
            why = _claim_refusal(_waiter(r) if r is not None else None, w, me)
            if why is None:
                tickets[key] = w.claim[0]
            else:
                unclaimed[key] = why
            continue
        who = (w.token, w.client.get("host"), w.client.get("pid"))
        claimed = sent_here.pop(who, None)
        if claimed is not None:
            tickets[key] = claimed
            continue
        if who in sent_away:
            gave_up.append(sent_away.pop(who))
        tickets[key] = insert(
            db, "INSERT INTO fleet_queue (server, token, client, request, only_gpus, "
                "redirectable, joined, state, gpus, spread) VALUES (?, ?, ?, ?, ?, ?, ?, 'waiting', ?, ?)",
            (me, w.token, json.dumps(w.client), json.dumps(w.request),
             json.dumps(list(w.only)) if w.only is not None else None, w.redirectable,
             w.joined, w.gpus, w.spread), key="ticket")
    if gave_up:
        db.execute(f"UPDATE fleet_queue SET state = 'gone' WHERE ticket IN {_in(gave_up)}",
                   tuple(gave_up))
        concerned.update(away_at[t] for t in gave_up)
    servers = {r["name"]: {"remoting": r["remoting"], "http": r["http"],
                           "fingerprint": r["fingerprint"],
                           "state": "up" if r["down"] is None else "down",
                           "heartbeat": r["heartbeat"], "down_since": r["down"]}
               for r in db.execute("SELECT * FROM servers").fetchall()}
    up = {name for name, s in servers.items() if s["state"] == "up"}
    # Nobody waits for a server that is down: its waiters are gone with it, and so are the
    # holds its GPUs had (their tickets' clients find the GPUs unavailable).
    down = sorted(set(servers) - up)
    if down:
        db.execute(f"DELETE FROM fleet_queue WHERE server IN ({', '.join('?' for _ in down)}) "
                   "AND state = 'waiting'", tuple(down))
    gpus = [_gpu(r) for r in db.execute(
        "SELECT * FROM fleet_gpus ORDER BY server, gpu_index").fetchall()]
    queue = [_waiter(r) for r in db.execute(
        "SELECT * FROM fleet_queue ORDER BY ticket").fetchall()]
    # A down server's leases are gone with it (as its GPUs are not offered).
    away_rows = [(r["server"], r["token"]) for r in db.execute(
        "SELECT server, token, gpus FROM fleet_away ORDER BY server, lease_id").fetchall()
        if r["server"] in up for _ in range(max(1, int(r["gpus"])))]
    assigned = match(gpus, queue, up, Counter(token for _, token in away_rows))
    if assigned:
        by_ticket = {w.ticket: w for w in queue}
        spread = {w.ticket for w in queue if w.spread}
        for ticket, parts in _by_ticket(assigned, spread).items():
            # Parts only for a lease of several servers: one server's whole is a lease of one
            # server, granted there or redirected as any other (no redirect of one part).
            server, indexes = parts[0]
            db.execute("UPDATE fleet_queue SET state = 'assigned', assigned_server = ?, "
                       "assigned_gpu = ?, assigned_gpus = ?, assigned_parts = ?, "
                       "assigned_at = ? WHERE ticket = ?",
                       (server, indexes[0], json.dumps(indexes),
                        json.dumps(parts) if len(parts) > 1 else None, now, ticket))
            for server, indexes in parts:
                for index in indexes:
                    db.execute("UPDATE fleet_gpus SET holder = ?, holder_token = ? WHERE "
                               "server = ? AND gpu_index = ?",
                               (ticket, by_ticket[ticket].token, server, index))
                concerned.add(server)
            concerned.add(by_ticket[ticket].server)
        gpus = [_gpu(r) for r in db.execute(
            "SELECT * FROM fleet_gpus ORDER BY server, gpu_index").fetchall()]
        queue = [_waiter(r) for r in db.execute(
            "SELECT * FROM fleet_queue ORDER BY ticket").fetchall()]
    # `match` above saw the whole fleet: a server this turn gave nothing to and took nothing from
    # has nothing to act on now (its clients' positions are a periodic sync away, SYNC_EVERY).
    others = sorted(s for s in concerned if s and s != me)  # (None: a ticket not assigned)
    if others:
        db.execute("SELECT pg_notify(?, ?)", (CHANNEL, " ".join(others)))
    return SyncResult(tickets, gpus, queue, servers, assigned, away_rows, unclaimed)


def snapshot(db: Any) -> tuple[list[GpuRow], list[QueueRow]]:
    """The fleet's GPUs and queue as they are (no lock: a view for the API)."""
    gpus = [_gpu(r) for r in db.execute(
        "SELECT * FROM fleet_gpus ORDER BY server, gpu_index").fetchall()]
    queue = [_waiter(r) for r in db.execute(
        "SELECT * FROM fleet_queue ORDER BY ticket").fetchall()]
    return gpus, queue


class SpreadQueries:
    """The spread-lease calls of StoreDB (which provides `_conn`)."""

    _conn: Any

    def spread_part(self, group: int, part: int) -> dict[str, Any] | None:
        """Where part `part` of spread lease `group` runs (issue 37, server-to-server links): the
        server of its open lease and how to reach it ({"server", "remoting", "fingerprint",
        "up"}), or None when no server holds that part now."""
        row = self._conn.execute(
            "SELECT l.server, s.remoting, s.fingerprint, s.down FROM leases l "
            "JOIN servers s ON s.name = l.server WHERE l.ended IS NULL AND l.spread_group = ? "
            "AND l.part = ? ORDER BY l.id DESC LIMIT 1", (group, part)).fetchone()
        if row is None:
            return None
        return {"server": row[0], "remoting": row[1], "fingerprint": row[2],
                "up": row[3] is None}
