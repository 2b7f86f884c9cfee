"""One queue for the fleet: servers sharing a PostgreSQL store give their GPUs out together.

With a shared store (`database = "postgresql://..."`) a server never grants its GPUs by itself.
Its waiters (pool/waitqueue.py: the clients of its handshakes, and its detached leases coming
back) join the fleet queue, and every decision is taken in one locked transaction of the store
(store/fleet.py) by `match` below: the first waiter in ticket order that may take a free GPU of
any live server gets it, a GPU of its own server first. So the order is FIFO across the fleet
and no GPU is ever given twice, whatever the timing between servers.

Then each server acts on what concerns it, in `_apply`:
- its waiter got one of its own GPUs: granted, as on a single server;
- its waiter got another server's GPU: the waiter's future resolves with a `Redirect`; the
  handshake answers the hello with GP_EREDIRECT and the address, and the client says the same
  hello there (the shim does it by itself; the program sees nothing);
- one of its GPUs went to another server's waiter: the GPU is held for that client (a
  reservation, REDIRECT_CLAIM_S at most, or the client's connect timeout when shorter: a timer
  wakes the fleet queue then, so a client that never arrives costs the GPU 2 s at most, not a
  whole sync period more). The redirected hello joins this server's queue, and the store gives
  it that ticket back (same token, host and pid: store/fleet.py) instead of a new one at the
  end, so it is granted the held GPU.

A client asking for several GPUs (GPUPOOL_GPUS=N, the row's `gpus`) is given N GPUs of one
server in one assignment (`match`: all or nothing, head of line), granted together there, or
held together for its redirected hello, claimed together, and released together when it never
arrives.

A client that asks to spread its lease (GP_HELLO_SPREAD, `spread = true`; protocol 1.8) and finds
no one server with N free takes them from several in one assignment (`match`, `_spread`). Its
server answers with every part (`Redirect.parts`: address, fingerprint, GPUs, first device;
`group` is the ticket), each part's server, its own included, holds its part as above, and the
client says one hello per part (spread_group, part), which the store gives that ticket back when
it names a part held there for the same client, or refuses (`PartRefused`, said to the client).
A part never claimed is let go and ends the ticket; the other servers, woken, let theirs go too
(docs/multi-gpu.md, "Across servers").

What a server tells and enforces about the queue is the fleet's (`waiting`, `counts`):
`max_queue` and `max_queue_per_token` count the clients waiting on every live server, and the
info reply's counts are the fleet's, the other servers' as of the last sync (a second old at
most: another server's new waiter NOTIFYs nobody, store/fleet.py), this server's as they are now.

The fleet queue decides; the lease manager grants (`grant`, `claim`, `release`, given at
construction) and pool/state.py moves the GPUs (`hold`). A server syncs when something changes
here (`kick`: the lease manager calls it instead of granting), when another server's sync
concerns it (a NOTIFY naming it, store/notify.py), and every SYNC_EVERY seconds anyway.
While the store cannot be reached, syncs fail and are retried: waiting clients keep waiting,
running leases are not touched (docs/architecture.md, "Fleet").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpupoold.gpu.inventory import Gpu
from gpupoold.pool.requirements import _INDEX, Requirements
from gpupoold.pool.slots import DRAINED, FREE, LEASED, QUARANTINED, Slot
from gpupoold.pool.state import PoolState, in_service
from gpupoold.pool.waitqueue import ClientInfo, Waiter, WaitQueue
from gpupoold.store.database import Store
from gpupoold.store.fleet import GpuRow, QueueRow, SyncInput, SyncResult
from gpupoold.tasks import stop_task

log = logging.getLogger("gpupoold.fleet")

SYNC_EVERY = 1.0  # seconds between syncs when nothing happens (positions, missed notices)
# How long a GPU is held for a redirected client to arrive. The client says its hello there at
# once (one connection set-up, milliseconds): 2 s, or its connect timeout when shorter (its
# hello says it since protocol 1.5: `claim_seconds`), after which a late client still joins the
# queue (with a new ticket) and the GPU serves whoever is next meanwhile.
REDIRECT_CLAIM_S = 2.0
# A spread lease's part is held `len(parts)` times that (at most SPREAD_CLAIM_MAX_S): the shim
# says its parts' hellos one after another, part k's only once part k-1's reply came, and that
# reply waits for its worker's start, so the last part arrives long after the first (a server-side
# mitigation until the shim sends every part's hello before reading the replies).
SPREAD_CLAIM_MAX_S = 10.0
CLAIM_SLACK_S = 0.02  # the deadline's timer fires this much after it (the loop's clock may round)
# Statuses a GPU row has while it serves nobody (drained, draining, quarantined).
OUT_OF_SERVICE = (QUARANTINED, DRAINED, "draining")


@dataclass(frozen=True)
class Part:
    """One part of a spread lease, as its redirect names it (protocol 1.8's redirect_part)."""

    server: str  # the server's name
    address: str  # where clients reach it (HOST:PORT, as it advertises it)
    fingerprint: str  # its registered TLS identity: the client's pin for it
    gpus: tuple[int, ...]  # its GPU indexes there, in device order
    first_device: int  # the program's ordinal of the part's first device


@dataclass(frozen=True)
class Redirect:
    """What a waiter's future resolves with when its GPU is on another server, or its GPUs on
    several (a spread lease: `group`, the fleet ticket its parts share, and `parts`)."""

    server: str  # the server's name
    address: str  # where clients reach it (HOST:PORT)
    gpu: int
    fingerprint: str = ""  # its registered TLS identity: the client's pin for it
    group: int = 0
    parts: tuple[Part, ...] = ()


class PartRefused(Exception):
    """A waiter's future fails with this when it is the hello of a spread lease's part and no
    part of that lease is held for it here; the message says why and what to do."""


@dataclass
class Reservation:
    ticket: int
    slots: list[Slot]  # the GPUs held (several for a client asking GPUPOOL_GPUS=N)
    row: QueueRow
    until: float  # time.monotonic() after which the GPU is released
    hold: float  # seconds it is held (claim_seconds)


def _client(q: QueueRow) -> ClientInfo:
    c = q.client
    return ClientInfo(host=str(c.get("host", "")), user=str(c.get("user", "")),
                      pid=int(c.get("pid", 0)), program=str(c.get("program", "")),
                      peer=str(c.get("peer", "")),
                      connect_timeout_ms=_nonneg_int(c.get("connect_timeout_ms")))


def _nonneg_int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def claim_seconds(q: QueueRow) -> float:
    """How long a GPU is held for the redirected client of `q`: REDIRECT_CLAIM_S, or its connect
    timeout when that is shorter (it gives up sooner; its hello says it, protocol 1.5)."""
    ms = _nonneg_int(q.client.get("connect_timeout_ms"))
    return min(REDIRECT_CLAIM_S, ms / 1000) if ms else REDIRECT_CLAIM_S


def hold_seconds(q: QueueRow) -> float:
    """How long a server holds its GPUs for the ticket of `q`: `claim_seconds`, and for a spread
    lease's part that many times its parts (SPREAD_CLAIM_MAX_S at most: the parts' hellos come
    one after another, each after the previous part's worker started)."""
    one = claim_seconds(q)
    return max(one, min(one * len(q.parts), SPREAD_CLAIM_MAX_S)) if q.parts else one


def _parts(q: QueueRow, res: SyncResult) -> tuple[int, tuple[Part, ...]]:
    """A spread lease's (group, parts) for its redirect, in device order ((0, ()) for a lease
    of one server): each part's server as it registered its address and fingerprint."""
    parts: list[Part] = []
    first = 0
    for server, gpus in q.parts:
        srv = res.servers.get(server, {})
        parts.append(Part(server, srv.get("remoting", ""), srv.get("fingerprint", ""), gpus,
                          first))
        first += len(gpus)
    return (q.ticket, tuple(parts)) if parts else (0, ())


def _is_part(w: Waiter) -> bool:
    """Whether `w` is the hello of a spread lease's part, which claims the GPUs held for it (a
    part's lease coming back after an idle detach is not: it takes its own GPUs back)."""
    return w.req.spread_group != 0 and w.returning is None and w.only is None


def _as_gpu(g: GpuRow) -> Gpu:
    return Gpu(index=g.index, name=g.name, uuid=g.uuid, simulated=g.simulated, driver="",
               ordinal=g.index, memory_total=g.memory_total)


def _may_take(w: QueueRow, g: GpuRow) -> bool:
    """Whether waiter `w` accepts GPU `g` as `match` decides it (the token limit aside)."""
    if g.server != w.server and (not w.redirectable or w.only is not None):
        return False
    return (w.only is None or g.index in w.only) and Requirements(**w.request).matches(_as_gpu(g))


def held_in_fleet(gpus: Sequence[GpuRow], up: set[str], away: Counter[str],
                  but_server: str | None = None) -> Counter[str]:
    """What each token holds in the fleet, as `max_gpus_per_token` counts it: the GPUs of the
    live servers leased, held or assigned to it, and its leases off a GPU (`away`: detached
    ones keep their claim). `but_server`: leaving out that server's GPUs."""
    held: Counter[str] = Counter(away)
    for g in gpus:
        if g.server in up and g.server != but_server and (g.holder is not None or g.token):
            held[g.holder_token or g.token] += 1
    return held


def in_turn(queue: Sequence[QueueRow], up: set[str], held: Counter[str]) -> list[QueueRow]:
    """The live servers' waiting rows in the fleet's turn: a waiter's rank is the number of GPUs
    its token holds in the fleet (`held`) plus the number of its token's waiters ahead of it;
    lower ranks first, then ticket order. A token holding a GPU and queueing many clients comes
    after another token's first client."""
    ahead: Counter[str] = Counter()
    ranked: list[tuple[int, int, QueueRow]] = []
    for w in sorted((w for w in queue if w.state == "waiting" and w.server in up),
                    key=lambda w: w.ticket):
        ranked.append((held[w.token] + ahead[w.token], w.ticket, w))
        ahead[w.token] += 1
    return [w for _rank, _ticket, w in sorted(ranked, key=lambda r: r[:2])]


def match(gpus: Sequence[GpuRow], queue: Sequence[QueueRow], up: set[str],
          max_gpus_per_token: int = 0,
          away: Counter[str] | None = None) -> list[tuple[int, str, int]]:
    """The assignments of free GPUs to waiters, as (ticket, server, GPU index): in turn
    (`in_turn`: fair between tokens, by what each holds; a server's own queue goes by who was
    served last, pool/waitqueue.py), each waiter takes as many free GPUs as it asks for (`gpus`,
    one but for GPUPOOL_GPUS=N) that it accepts, all on one server: its own server first (no
    redirect), then the other servers in name order, the first that has them all free.

    All or nothing, head of line, as on one server (pool/leases.py's `_grant_next`): a waiter
    for N GPUs that finds no server with N free takes none, and the free GPUs it accepts on the
    server nearest to serving it (the most of them free; its own first, then name order), one
    with N in service that it accepts, are held back from the waiters behind it: GPUs freed
    there one by one gather for it rather than go to later, smaller requests, so it waits only
    for the leases before it there, never for ever. It blocks nobody elsewhere: the other
    servers' free GPUs serve the waiters behind it. A waiter no live server can ever serve (too
    few GPUs it accepts in service: drained or quarantined since it joined) holds nothing back.

    A waiter that asked to spread (`spread`: GP_HELLO_SPREAD) and finds no server with N free
    takes N of the free GPUs it accepts in the whole fleet when there are N (`_spread`: its own
    server's first, then the most free first, all in this one assignment). While fewer than N
    are free in the fleet it holds back every free GPU it accepts (it could use any of them), so
    it waits only for N to be free anywhere, never for ever, and blocks nobody once served; one
    the live servers together can never serve holds nothing back.

    A token at `max_gpus_per_token` waits: the GPUs of the whole fleet held or assigned to it,
    its leases off a GPU (`away`, by token: as many as each holds) and the N it asks for count.
    A detached lease coming back (a waiter with `only`) is counted in `away` already: it takes
    its own place back, and waits only while its token holds more than the limit otherwise."""
    free = [g for g in gpus if g.free and g.holder is None and g.server in up]
    held = held_in_fleet(gpus, up, away or Counter())
    taken: set[tuple[str, int]] = set()  # assigned in this match, or held back for a waiter
    out: list[tuple[int, str, int]] = []
    for w in in_turn(queue, up, held):
        returning = w.only is not None
        need = max(1, w.gpus)
        own = need if returning else 0  # (its own GPUs, counted in `away` already)
        if max_gpus_per_token > 0 and held[w.token] - own + need > max_gpus_per_token:
            continue
        req = Requirements(**w.request)
        by_server = _free_it_accepts(w, req, [g for g in free if (g.server, g.index) not in taken])
        there = next((s for s in by_server if len(by_server[s]) >= need), None)
        parts = [by_server[there][:need]] if there is not None else None
        if parts is None and need > 1 and w.spread and w.redirectable and not returning:
            parts = _spread(w, by_server, need)
            if parts is None:  # fewer than N free in the fleet: it waits, holding back those
                if _could_serve_spread(w, req, gpus, up, need):
                    taken.update((g.server, g.index) for gs in by_server.values() for g in gs)
                continue
        if parts is not None:
            for g in (g for gs in parts for g in gs):
                taken.add((g.server, g.index))
                out.append((w.ticket, g.server, g.index))
            if not returning:  # (a returning lease moves from `away` onto the GPUs)
                held[w.token] += need
            continue
        if need > 1:
            servers = [s for s in by_server if _could_serve(w, req, gpus, s, need)]
            if servers:  # the most free first; `by_server` is its own server first, then names
                nearest = max(servers, key=lambda s: len(by_server[s]))
                taken.update((g.server, g.index) for g in by_server[nearest])
    return out


def _spread(w: QueueRow, by_server: dict[str, list[GpuRow]],
            need: int) -> list[list[GpuRow]] | None:
    """A spread lease's parts (`w` asked GP_HELLO_SPREAD and no one server has `need` free):
    `need` of the free GPUs it accepts (`by_server`), its own server's first (no redirect for
    those), then the servers with the most free first (the fewest parts; name order between
    equals); None when the fleet has fewer than `need` of them free."""
    if sum(len(gs) for gs in by_server.values()) < need:
        return None
    order = sorted(by_server, key=lambda s: (s != w.server, -len(by_server[s]), s))
    parts: list[list[GpuRow]] = []
    for server in order:
        part = by_server[server][:need - sum(len(p) for p in parts)]
        if part:
            parts.append(part)
    return parts


def _could_serve_spread(w: QueueRow, req: Requirements, gpus: Sequence[GpuRow], up: set[str],
                        need: int) -> bool:
    """Whether the live servers together have `need` GPUs in service that spread waiter `w`
    accepts, busy ones included (if not, it holds nothing back: it is never served)."""
    return sum(1 for g in gpus if g.server in up and g.state not in OUT_OF_SERVICE
               and req.matches(_as_gpu(g))) >= need


def _free_it_accepts(w: QueueRow, req: Requirements,
                     free: Sequence[GpuRow]) -> dict[str, list[GpuRow]]:
    """The free GPUs waiter `w` accepts, by server: its own server first, then the others in
    name order (`free` is in server, index order)."""
    out: dict[str, list[GpuRow]] = {w.server: []}
    for g in free:
        if g.server != w.server and (not w.redirectable or w.only is not None):
            continue
        if w.only is not None and g.index not in w.only:
            continue
        if req.matches(_as_gpu(g)):
            out.setdefault(g.server, []).append(g)
    return {s: gs for s, gs in out.items() if gs}


def _could_serve(w: QueueRow, req: Requirements, gpus: Sequence[GpuRow], server: str,
                 need: int) -> bool:
    """Whether `server` has `need` GPUs in service that `w` accepts, busy ones included."""
    return sum(1 for g in gpus if g.server == server and g.state not in OUT_OF_SERVICE
               and (w.only is None or g.index in w.only) and req.matches(_as_gpu(g))) >= need


class FleetQueue:
    """This server's part of the fleet queue (see the top). Built by the lease manager with what
    it uses of it: `grant(slot, waiter, others)` gives free GPUs to a waiter here (`others`: the
    rest of a request of several), `claim(slot, waiter, others)` held ones to the redirected
    client's waiter, `release(slot)` frees a held GPU nobody claimed, `closing()` says the
    daemon stops."""

    def __init__(self, pool: PoolState, queue: WaitQueue, store: Store,
                 max_gpus_per_token: int = 0, *,
                 grant: Callable[[Slot, Waiter, list[Slot]], None],
                 claim: Callable[[Slot, Waiter, list[Slot]], None],
                 release: Callable[[Slot], None],
                 closing: Callable[[], bool]) -> None:
        self.pool = pool
        self.queue = queue
        self._grant_to = grant
        self._claim = claim
        self._release_held = release
        self._closing = closing
        self.store = store
        self.server = store.server
        self.max_gpus_per_token = max_gpus_per_token
        self._kick = asyncio.Event()
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._keys = 0
        self._tickets: dict[Waiter, int] = {}  # this server's waiters in the fleet queue
        self._gone: list[int] = []
        self._finished: list[int] = []
        self._unassign: list[int] = []
        self._applied: dict[int, int] = {}  # GPU index -> the ticket it serves
        self._reservations: dict[int, Reservation] = {}  # ticket -> held GPU
        self._positions: dict[int, tuple[int, int]] = {}  # ticket -> (position, waiting)
        self.last: SyncResult | None = None  # the fleet as the last sync saw it
        self.last_ok = 0.0  # time.time() of the last sync that reached the store
        self.error: str | None = None  # why the last sync failed (None: it did not)
        self.syncs = 0
        # Seconds each of the last syncs that reached the store took, its lock wait included
        # (/api/v1/fleet `sync_ms`; bench/fleet_scale.py reports them).
        self.sync_seconds: deque[float] = deque(maxlen=1000)

    # --------------------------------------------------------------------- the lease manager's
    def kick(self) -> None:
        """Something changed here (a waiter came or left, a GPU changed): sync soon."""
        self._kick.set()

    def under_limit(self, token: str, returning: int | None = None, need: int = 1) -> bool:
        """Whether `token` may take `need` more GPUs as the fleet counts (`match`): the other
        live servers' part as of the last sync, this server's as it is now (pool/state.py's
        `held`, leaving out a detached lease coming back: `returning`)."""
        if self.max_gpus_per_token <= 0:
            return True
        mine = self.pool.held(token, but=returning) + need - 1
        if self.last is None:
            return mine < self.max_gpus_per_token
        up = {name for name, s in self.last.servers.items() if s.get("state") == "up"}
        away = Counter(t for server, t in self.last.away
                       if server != self.server and server in up)
        others = held_in_fleet(self.last.gpus, up, away, but_server=self.server)
        return others[token] + mine < self.max_gpus_per_token

    def _up(self) -> set[str]:
        """The live servers as of the last sync."""
        if self.last is None:
            return {self.server}
        return {name for name, s in self.last.servers.items() if s.get("state") == "up"}

    def waiting(self, token: str | None = None) -> int:
        """The clients waiting for a GPU in the fleet (of `token`: its new clients, not its
        detached leases coming back, as `max_queue_per_token` counts them): the other live
        servers' as of the last sync, this server's as its queue is now."""
        here = len(self.queue) if token is None else self.queue.waiting(token)
        if self.last is None:
            return here
        up = self._up()
        return here + sum(
            1 for q in self.last.queue
            if q.state == "waiting" and q.server != self.server and q.server in up
            and (token is None or (q.token == token and q.only is None)))

    def counts(self, req: Requirements, token: str,
               here: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
        """The info reply's counts for the fleet: `here` (this server's GPUs, those meeting
        `req` in service, those a hello would get at once; its waiters) plus the other live
        servers' GPUs as of the last sync (one is free for `token` when free, unheld, meeting
        `req`, the token under its fleet-wide limit and no waiter of the fleet that may take it
        ahead), and the fleet's waiters."""
        gpus, matching, free, _ = here
        if self.last is None:
            return gpus, matching, free, self.waiting()
        up = self._up()
        may_take = self.under_limit(token)
        waiting: list[QueueRow] | None = None  # made only for a free GPU (few, when many wait)
        for g in self.last.gpus:
            if g.server == self.server or g.server not in up:
                continue
            gpus += 1
            gpu = _as_gpu(g)
            if g.state in OUT_OF_SERVICE or not req.matches(gpu):
                continue
            matching += 1
            if not (may_take and g.free and g.holder is None):
                continue
            if waiting is None:
                waiting = [q for q in self.last.queue if q.state == "waiting" and q.server in up]
            if not any(_may_take(q, g) for q in waiting):
                free += 1
        return gpus, matching, free, self.waiting()

    def elsewhere(self, req: Requirements) -> bool:
        """Whether another live server has as many GPUs in service that meet `req` as it asks
        for (one, or GPUPOOL_GPUS=N: all from one server), as of the last sync, and `req` may be
        served there (a GPU named by index means this server's)."""
        if _INDEX.fullmatch(req.gpu):
            return False
        there = self.in_service_elsewhere(req)
        if req.spread and req.gpus > 1:  # from several servers: the whole fleet's count
            here = sum(1 for s in self.pool.slots if in_service(s) and req.matches(s.gpu))
            return here + sum(there.values()) >= req.gpus
        return any(n >= req.gpus for n in there.values())

    def too_many(self, req: Requirements, here: int, redirectable: bool) -> str:
        """The refusal of a request for several GPUs that no live server of the fleet can serve
        (all its GPUs come from one server: `match`): the counts of this server (`here`: its
        GPUs in service that meet `req`) and of the largest other one."""
        there = self.in_service_elsewhere(req)
        most, where = max(((n, name) for name, n in there.items()), default=(0, ""))
        if not redirectable or _INDEX.fullmatch(req.gpu):
            return (f"GPUPOOL_GPUS asked for {req.gpus} GPUs at once, and this server has {here}"
                    f" in service that meet the request ({req.describe()}); the client asks "
                    "for this server's GPUs only (GPUPOOL_GPU names a GPU by index, or its shim "
                    "does not follow redirects), so no other server of the fleet can serve it: "
                    f"ask for at most {here} (GPUPOOL_GPUS / gpus =)")
        other = (f"the largest other live server, {where}, has {most}" if there
                 else "no other live server has any")
        if req.spread:  # from several servers: all of the fleet's count
            total = here + sum(there.values())
            return (f"GPUPOOL_GPUS asked for {req.gpus} GPUs at once from several servers "
                    f"(spread), and the live servers of the fleet have {total} in service that "
                    f"meet the request ({req.describe()}) in all: this one has {here}, {other}. "
                    f"Ask for at most {total} (GPUPOOL_GPUS / gpus =), or ask the operator")
        return (f"GPUPOOL_GPUS asked for {req.gpus} GPUs at once, and no live server of the "
                f"fleet has {req.gpus} in service that meet the request ({req.describe()}): "
                f"this one has {here}, {other}. A lease of several GPUs comes from one server "
                "unless the client asks to spread it (spread = true, GPUPOOL_SPREAD=1): ask for "
                f"at most {max(here, most)} (GPUPOOL_GPUS / gpus =), spread it, or ask the "
                "operator")

    def in_service_elsewhere(self, req: Requirements) -> dict[str, int]:
        """How many GPUs in service that meet `req` each other live server has, as of the last
        sync (the refusal of a request no server can serve says them)."""
        out: dict[str, int] = {}
        if self.last is None:
            return out
        up = self._up()
        for g in self.last.gpus:
            if g.server != self.server and g.server in up and g.state not in OUT_OF_SERVICE \
                    and req.matches(_as_gpu(g)):
                out[g.server] = out.get(g.server, 0) + 1
        return out

    def position(self, w: Waiter) -> tuple[int, int]:
        """(place in the fleet queue, waiting in the fleet), as of the last sync; (0, n) before
        the waiter's first sync."""
        ticket = self._tickets.get(w)
        if ticket is None:
            return 0, len(self.last.queue) if self.last else 0
        return self._positions.get(ticket, (0, 0))

    # ---------------------------------------------------------------------------- life cycle
    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="fleet-queue")
        self.kick()

    async def close(self) -> None:
        """A last sync (best effort): this server's waiters and free GPUs leave the fleet."""
        await stop_task(self._task)
        self._task = None
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.sync(), 3.0)

    async def _run(self) -> None:
        while True:
            # asyncio.timeout, not wait_for: on Python 3.11 a cancellation (stop_task at a stop)
            # that meets wait_for's inner task could leave this task cancelling for ever and
            # the daemon's stop hanging (seen with a stop right after the start).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(SYNC_EVERY):
                    await self._kick.wait()
            self._kick.clear()
            try:
                await self.sync()
            except Exception:  # noqa: BLE001 - a bug here must not end the fleet queue
                log.exception("fleet queue: sync failed")
                await asyncio.sleep(SYNC_EVERY)

    async def sync(self) -> bool:
        """One turn in the fleet's shared state; False when the store could not be reached."""
        async with self._lock:
            self._expire_reservations()
            inp, new = self._input()
            began = time.monotonic()
            try:
                res = await self.store.fleet_sync(
                    inp, lambda g, q, up, away: match(g, q, up, self.max_gpus_per_token, away))
            except Exception as exc:  # the database is down or unreachable: try again later
                # Nothing of it happened: all of it is sent again next time.
                self._gone = inp.gone + self._gone
                self._finished = inp.finished + self._finished
                self._unassign = inp.unassign + self._unassign  # (new waiters: still queued)
                if self.error is None:
                    log.error("fleet queue: cannot reach the store (%s); waiting clients keep "
                              "waiting, running leases go on; retrying every %g s", exc,
                              SYNC_EVERY)
                self.error = str(exc) or type(exc).__name__
                return False
            if self.error is not None:
                log.warning("fleet queue: the store is reachable again")
            self.error = None
            self.last_ok = time.time()
            self.syncs += 1
            self.sync_seconds.append(time.monotonic() - began)
            self._apply(res, new)
            return True

    # ------------------------------------------------------------------------------ one turn
    def _input(self) -> tuple[SyncInput, dict[int, Waiter]]:
        finished: list[int] = self._finished
        self._finished = []
        gpus = []
        for slot in self.pool.slots:
            i = slot.gpu.index
            ticket = self._applied.get(i)
            if ticket is not None and slot.state != LEASED:  # its lease or hold is over
                finished.append(ticket)
                del self._applied[i]
            lease = slot.lease
            gpus.append(GpuRow(
                server=self.server, index=i, uuid=slot.gpu.uuid, name=slot.gpu.name,
                memory_total=slot.gpu.memory_total, simulated=slot.gpu.simulated,
                state="draining" if slot.draining and slot.state == LEASED else slot.state,
                free=(slot.state == FREE and in_service(slot)
                      and not self._closing() and i not in self._applied),
                lease_id=lease.id if lease is not None else None,
                token=slot.holder() or "", updated=0.0))
        waiting = set(self.queue)
        gone = self._gone
        self._gone = []
        for w, ticket in list(self._tickets.items()):
            if w not in waiting:  # left (or refused at a stop) without the fleet's GPU
                gone.append(ticket)
                del self._tickets[w]
        new: dict[int, Waiter] = {}
        rows = []
        # In the order they joined (the queue's, not the set's): two clients arriving between
        # two syncs get their fleet tickets in their order.
        for w in self.queue:
            if w in self._tickets:
                continue
            self._keys += 1
            new[self._keys] = w
            only = None
            if w.returning is not None or w.only is not None:
                only = tuple(s.gpu.index for s in self.pool.slots if w.accepts(s.gpu))
            rows.append((self._keys, QueueRow(
                ticket=0, server=self.server, token=w.token,
                client={**w.client.to_json(), "connect_timeout_ms": w.client.connect_timeout_ms},
                request={"gpu": w.req.gpu, "model": w.req.model,
                         "min_memory": w.req.min_memory},
                only=only, redirectable=w.redirectable and not _INDEX.fullmatch(w.req.gpu),
                joined=w.joined_wall, state="waiting", gpus=w.req.gpus,
                spread=w.req.spread and w.redirectable and only is None,
                claim=(w.req.spread_group, w.req.part, w.req.parts) if _is_part(w) else None)))
        unassign = self._unassign
        self._unassign = []
        off = self.pool.away()
        away = [(lease.id, lease.token) for lease in off]
        away_gpus = {lease.id: len(lease.homes) for lease in off if len(lease.homes) > 1}
        return SyncInput(self.server, gpus, rows, gone, finished, unassign, away,
                         away_gpus), new

    def _apply(self, res: SyncResult, new: dict[int, Waiter]) -> None:
        self.last = res
        waiting_now = set(self.queue)
        # The tickets whose part here a hello claimed already (granted, or given to a waiter):
        # another hello for that part is refused, not left waiting for a hold that is no more.
        claimed = {t for t in self._applied.values() if t not in self._reservations}
        claimed.update(self._tickets.values())
        for key, ticket in res.tickets.items():
            w = new[key]
            if _is_part(w) and ticket in claimed:
                self.queue.leave(w)
                if not w.future.done():
                    w.future.set_exception(PartRefused(
                        f"part {w.req.part} of the spread lease {ticket} is already claimed on "
                        f"server {self.server} (by an earlier hello of this client): a part is "
                        "claimed once; run the program again for a new lease"))
                continue
            if w in waiting_now:
                self._tickets[w] = ticket
            elif not _is_part(w):
                self._gone.append(ticket)  # it left during the sync
            # (a spread lease's part that left: its hold runs out, and the lease with it)
        for key, why in res.unclaimed.items():  # a spread lease's part with nothing held here
            w = new[key]
            self.queue.leave(w)
            if not w.future.done():
                w.future.set_exception(PartRefused(why))
        rows = {q.ticket: q for q in res.queue}
        # Waiters of this server whose rows are no longer in the fleet queue: another server
        # marked this one down while it could not reach the store (its waiting rows went with
        # it). They join again at the next sync (new tickets) rather than wait for ever.
        # (A spread lease's part whose ticket another server ended is one too, not a sign of that:
        # its hello joins again and is refused, the part no longer held.)
        lost = [w for w, ticket in self._tickets.items() if ticket not in rows]
        for w in lost:
            del self._tickets[w]
        if lost:
            waiters = sum(1 for w in lost if not _is_part(w))
            if waiters:
                log.warning("fleet queue: %d waiter(s) of this server had left the fleet queue "
                            "(this server was marked down meanwhile): queued again", waiters)
            self.kick()
        up = {name for name, srv in res.servers.items() if srv.get("state") == "up"}
        held = held_in_fleet(res.gpus, up, Counter(token for _, token in res.away))
        line = [q.ticket for q in in_turn(res.queue, up, held)]
        self._positions = {t: (n + 1, len(line)) for n, t in enumerate(line)}
        by_ticket = {t: w for w, t in self._tickets.items()}
        # This server's waiters sent to another server's GPU, or to the parts of a spread lease
        # (its own server's part too: a part is claimed by a hello of its own).
        for ticket, w in list(by_ticket.items()):
            q = rows.get(ticket)
            if q is None or q.state != "assigned" or _is_part(w) \
                    or (q.assigned_server == self.server and not q.parts):
                continue
            server = res.servers.get(q.assigned_server or "", {})
            del self._tickets[w]
            del by_ticket[ticket]
            self.queue.leave(w)
            if not w.future.done():
                w.future.set_result(Redirect(q.assigned_server or "", server.get("remoting", ""),
                                             q.assigned_gpu or 0, server.get("fingerprint", ""),
                                             *_parts(q, res)))
        # This server's GPUs given to a ticket (several for a request of several, all at once):
        # granted to the waiter here that has it (its own, or a redirected client that arrived:
        # the store gave its hello that ticket), or held for the client still on its way.
        given: dict[int, list[GpuRow]] = {}
        for g in res.gpus:
            if g.server == self.server and g.holder is not None:
                given.setdefault(g.holder, []).append(g)
        for ticket, gs in given.items():
            q = rows.get(ticket)
            w = by_ticket.get(ticket)
            held = self._reservations.get(ticket)
            if any(self._applied.get(g.index) == ticket for g in gs):
                if held is not None and w is not None and w in waiting_now:
                    del self._reservations[ticket]
                    self._tickets.pop(w, None)
                    self._claim(held.slots[0], w, held.slots[1:])
                elif held is not None and (q is None or q.state == "gone"):
                    self._release(held, "its client is gone")
                continue
            slots = [self._slot(g.index) for g in gs]
            if q is None or q.state == "gone" or None in slots:
                self._finished.append(ticket)
                continue
            ready = [s for s in slots if s is not None]
            mine = q.part_here(self.server)
            if (len(ready) != (len(mine) if q.parts else q.gpus) or self._closing()
                    or any(s.state != FREE or not in_service(s) for s in ready)):
                # It changed meanwhile: back to the queue; a spread lease's waiter was sent its
                # parts already, so that lease is over (its part hello here is refused; the
                # other servers let their parts go, the ticket being gone).
                (self._gone if q.parts else self._unassign).append(ticket)
                continue
            ready.sort(key=lambda s: mine.index(s.gpu.index)
                       if s.gpu.index in mine else s.gpu.index)
            if w is not None and w in waiting_now and not w.future.done():
                self._applied.update((s.gpu.index, ticket) for s in ready)
                self._grant(ready, w)
            elif q.server == self.server and not q.parts:  # its waiter left just now
                self._unassign.append(ticket)
            else:
                self._applied.update((s.gpu.index, ticket) for s in ready)
                self._hold(ready, ticket, q)
        if self._gone or self._finished or self._unassign:
            self.kick()

    def _grant(self, slots: list[Slot], w: Waiter) -> None:
        self._tickets.pop(w, None)
        self._grant_to(slots[0], w, slots[1:])

    def _slot(self, index: int) -> Slot | None:
        return next((s for s in self.pool.slots if s.gpu.index == index), None)

    def _hold(self, slots: list[Slot], ticket: int, q: QueueRow) -> None:
        # A stand-in for the client on its way: the GPUs' holder in the views, and a grant the
        # watchdog knows (one never claimed is released long before its limit). A client asking
        # for several GPUs has them all held, claimed together, and released together.
        stand_in = Waiter(-ticket, Requirements(**q.request, gpus=len(slots)), q.token, _client(q),
                          asyncio.get_running_loop().create_future())
        for slot in slots:
            self.pool.hold(slot, stand_in)
        hold = hold_seconds(q)
        self._reservations[ticket] = Reservation(ticket, slots, q, time.monotonic() + hold, hold)
        # A sync at the deadline (the released GPU goes to the next waiter then, not up to
        # SYNC_EVERY later). The release itself happens in the sync, under its lock: between
        # two syncs the store may be giving this very ticket to the client's hello.
        asyncio.get_running_loop().call_later(hold + CLAIM_SLACK_S, self.kick)
        part = next((f"part {k} of {len(q.parts)} of a spread lease, "
                     for k, (there, _) in enumerate(q.parts) if there == self.server), "")
        log.info("GPU %s held (%s%g s) for %s@%s pid %s, sent here by server %s (ticket %d)",
                 ", ".join(str(s.gpu.index) for s in slots), part, hold, q.client.get("user"),
                 q.client.get("host"), q.client.get("pid"), q.server, ticket)

    def _release(self, r: Reservation, why: str) -> None:
        self._reservations.pop(r.ticket, None)
        for slot in r.slots:
            if slot.state == LEASED and slot.lease is None and slot.reserved is not None \
                    and slot.reserved.ticket == -r.ticket:
                log.info("GPU %d no longer held for ticket %d: %s", slot.gpu.index, r.ticket, why)
                self._release_held(slot)  # free again (the next sync finishes the ticket)

    def _expire_reservations(self) -> None:
        now = time.monotonic()
        # A redirected client that arrived and waits for this sync to give it its ticket back
        # keeps its GPU, however late.
        arrived = {(w.token, w.client.host, w.client.pid) for w in self.queue
                   if w not in self._tickets}
        for r in list(self._reservations.values()):
            c = r.row.client
            if now >= r.until and (r.row.token, c.get("host"), c.get("pid")) not in arrived:
                self._release(r, f"its client did not arrive within {r.hold:g} s")

    def holds(self, slot: Slot) -> bool:
        """Whether `slot` is held for a redirected client (leased, no lease yet)."""
        return any(slot in r.slots for r in self._reservations.values())
