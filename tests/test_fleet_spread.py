"""A lease of N GPUs spread over several servers of a fleet (issue 37, item 3: `spread = true`,
the hello flag GP_HELLO_SPREAD of protocol 1.8), the server side: the fleet's match gives a spread
waiter that no one server can serve its N GPUs from several servers in one assignment (its own
server first, then the most free first), its server answers with the parts, each part's server
holds its GPUs until a part's hello (spread_group, part) claims them, and a part never claimed
is let go. First the decisions alone (`match`), then the store's rows (PostgreSQL), then two
lease managers sharing it (the `server` fixture of test_fleet_one_queue.py: fake workers, the
real fleet queue and store)."""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import gpupool_protocol as gp
import pytest
from conftest import wait_until
from gpupool.wire.frames import read_frame
from test_fleet import gpu, waiter
from test_fleet_multi_gpu import ended
from test_fleet_one_queue import Server, leased, server, sync  # noqa: F401  (server: a fixture)
from test_hostile_tenant import VA_BASE, VA_SIZE
from test_leases import client, lease_on, mgr  # noqa: F401  (mgr: a fixture)

from gpupoold.pool.fleet import (
    REDIRECT_CLAIM_S,
    SPREAD_CLAIM_MAX_S,
    Part,
    PartRefused,
    Redirect,
    hold_seconds,
    match,
)
from gpupoold.pool.fleet_view import fleet_queue
from gpupoold.pool.leases import QueueFull
from gpupoold.pool.requirements import MAX_SPREAD_GROUP, Requirements
from gpupoold.pool.slots import FREE, LEASED
from gpupoold.pool.views import lease_view
from gpupoold.remoting.handshake import Refusal, parse_hello
from gpupoold.store.database import StoreDB
from gpupoold.store.fleet import QueueRow, SyncInput, _by_ticket

UP = {"a", "b", "c"}


def spread(ticket: int, where: str, n: int, **kw: object) -> QueueRow:
    return replace(waiter(ticket, where, **kw), gpus=n, spread=True)  # type: ignore[arg-type]


def wants(ticket: int, where: str, n: int) -> QueueRow:
    return replace(waiter(ticket, where), gpus=n)


# ----------------------------------------------------------------------------- the decisions
def test_4_over_two_servers_of_2_free_its_own_first_in_device_order() -> None:
    gpus = [gpu("a"), gpu("a", 1), gpu("b"), gpu("b", 1)]
    assert match(gpus, [spread(1, "b", 4)], UP) == [(1, "b", 0), (1, "b", 1), (1, "a", 0),
                                                   (1, "a", 1)]
    # Its own server has none free: the server with the most free first (fewest parts).
    gpus = [gpu("a"), gpu("b"), gpu("b", 1), gpu("b", 2), gpu("c", free=False)]
    assert match(gpus, [spread(1, "c", 4)], UP) == [(1, "b", 0), (1, "b", 1), (1, "b", 2),
                                                   (1, "a", 0)]
    # Its own server's one free GPU first even when another has more.
    gpus = [gpu("a"), gpu("b"), gpu("b", 1), gpu("b", 2), gpu("c")]
    assert match(gpus, [spread(1, "c", 4)], UP) == [(1, "c", 0), (1, "b", 0), (1, "b", 1),
                                                   (1, "b", 2)]


def test_one_server_first_and_never_fewer_nor_more_than_n() -> None:
    # b has 4 free: one machine serves it whole, though its own server has 2.
    gpus = [gpu("a"), gpu("a", 1)] + [gpu("b", i) for i in range(4)]
    assert match(gpus, [spread(1, "a", 4)], UP) == [(1, "b", i) for i in range(4)]
    # 3 free in the whole fleet: nothing for a waiter of 4; 6 free: exactly 4.
    gpus = [gpu("a"), gpu("a", 1), gpu("b"), gpu("b", 1, free=False)]
    assert match(gpus, [spread(1, "a", 4)], UP) == []
    gpus = [gpu(s, i) for s in ("a", "b", "c") for i in range(2)]
    got = match(gpus, [spread(1, "a", 4)], UP)
    assert len(got) == 4 and len(set(got)) == 4


def test_a_waiter_that_did_not_ask_to_spread_is_never_given_parts() -> None:
    gpus = [gpu("a"), gpu("a", 1), gpu("b"), gpu("b", 1)]
    assert match(gpus, [wants(1, "a", 4)], UP) == []
    # nor one that may not leave its server (no redirect), nor a detached lease coming back
    assert match(gpus, [spread(1, "a", 4, redirectable=False)], UP) == []
    assert match(gpus, [spread(1, "a", 4, only=(0, 1))], UP) == []
    # The store refuses a match that would give a ticket not spread GPUs of two servers.
    with pytest.raises(ValueError, match="two servers"):
        _by_ticket([(1, "a", 0), (1, "b", 0)])
    assert _by_ticket([(1, "a", 1), (1, "b", 0), (1, "a", 0)], {1}) == {
        1: [("a", [1, 0]), ("b", [0])]}


def test_a_spread_waiter_waits_only_while_fewer_than_n_are_free_in_the_fleet() -> None:
    # 4 in service, 3 free: the waiter for 4 holds the 3 back (head of line), so the GPU freed
    # next completes its lease rather than going to a later, smaller request.
    gpus = [gpu("a"), gpu("a", 1, free=False), gpu("b"), gpu("b", 1)]
    queue = [spread(1, "a", 4), waiter(2, "a"), waiter(3, "b")]
    assert match(gpus, queue, UP) == []
    gpus[1] = gpu("a", 1)
    assert match(gpus, queue, UP) == [(1, "a", 0), (1, "a", 1), (1, "b", 0), (1, "b", 1)]
    # Served, it blocks nobody: the waiters behind it take what is left (c's GPU).
    assert match([*gpus, gpu("c")], queue, UP)[4:] == [(2, "c", 0)]
    # A fleet that can never serve it (3 in service: a's second GPU drained) holds nothing back.
    gpus = [gpu("a"), replace(gpu("a", 1), state="drained", free=False), gpu("b"), gpu("b", 1)]
    assert match(gpus, queue, UP) == [(2, "a", 0), (3, "b", 0)]
    # A server that is down counts for nothing.
    gpus = [gpu("a"), gpu("a", 1), gpu("b"), gpu("b", 1)]
    assert match(gpus, queue, {"a"}) == [(2, "a", 0)]


# ----------------------------------------------------------------------- the store's rows
def test_the_store_keeps_the_parts_and_gives_a_part_hello_its_ticket_back(pg_url: str) -> None:
    a, b = StoreDB(pg_url, server="a"), StoreDB(pg_url, server="b")
    try:
        for db in (a, b):
            db.server_up(f"{db.server}:1", f"{db.server}:2", time.time())
        b.fleet_sync(SyncInput("b", [gpu("b"), gpu("b", 1)], []), _match)
        res = a.fleet_sync(SyncInput("a", [gpu("a"), gpu("a", 1)],
                                     [(1, replace(spread(0, "a", 4), client=_who))]), _match)
        ticket = res.tickets[1]
        row = next(q for q in res.queue if q.ticket == ticket)
        assert (row.state, row.spread, row.parts) == ("assigned", True,
                                                      (("a", (0, 1)), ("b", (0, 1))))
        assert (row.assigned_server, row.assigned_gpus) == ("a", (0, 1))
        assert {(g.server, g.index) for g in res.gpus if g.holder == ticket} == {
            ("a", 0), ("a", 1), ("b", 0), ("b", 1)}

        def part(k: int, **kw: object) -> QueueRow:
            return replace(wants(0, "b", 2), **{"client": _who, "claim": (ticket, k, 2),
                                                **kw})  # type: ignore[arg-type]
        # Part 1's hello at b gets the ticket back; wrong part, client or count are refused.
        got = b.fleet_sync(SyncInput("b", [gpu("b", holder=ticket), gpu("b", 1, holder=ticket)],
                                     [(1, part(1)), (2, part(0)), (3, part(5)),
                                      (4, part(1, client={**_who, "pid": 9})),
                                      (5, part(1, gpus=3)),
                                      (6, part(1, claim=(ticket, 1, 3)))]), _match)
        assert got.tickets == {1: ticket}
        assert "held on server a, not on this one (b)" in got.unclaimed[2]
        assert "has 2 parts (0 to 1)" in got.unclaimed[3]
        assert "held for another client" in got.unclaimed[4]
        assert "holds 2 GPUs on server b, and this hello asks for 3" in got.unclaimed[5]
        assert "that lease has 2 parts, and this hello says 3" in got.unclaimed[6]
        assert len(got.queue) == 1  # no new ticket for any of them
        # Once the ticket is over (a's hold let go), a late part hello is told so.
        a.fleet_sync(SyncInput("a", [gpu("a"), gpu("a", 1)], [], finished=[ticket]), _match)
        late = b.fleet_sync(SyncInput("b", [gpu("b"), gpu("b", 1)], [(1, part(1))]), _match)
        assert "no longer held on server b" in late.unclaimed[1]
    finally:
        a.close()
        b.close()


_who = {"host": "h", "pid": 7}


def _match(g, q, up, away):  # type: ignore[no-untyped-def]
    return match(g, q, up, 0, away)


# ----------------------------------------------------------- two servers sharing one store
def _part(group: int, k: int, n: int = 2) -> Requirements:
    return Requirements(gpus=n, spread_group=group, part=k, parts=2)


async def test_the_redirect_names_the_parts_and_each_part_hello_claims_its_gpus(
        server: Server) -> None:  # noqa: F811
    a = await server("a", 2)
    b = await server("b", 2)
    await sync(b, a)
    assert a.feasible(Requirements(gpus=4, spread=True), redirectable=True) is None
    why = a.feasible(Requirements(gpus=5, spread=True), redirectable=True)
    assert why is not None and "the live servers of the fleet have 4 in service" in why
    assert "Ask for at most 4" in why
    assert a.feasible(Requirements(gpus=4), redirectable=True) is not None  # not spread
    w = a.enqueue(Requirements(gpus=4, spread=True), "alice", client(2), redirectable=True)
    await sync(a)
    sent = await asyncio.wait_for(w.future, 1)
    assert isinstance(sent, Redirect) and sent.group > 0
    assert sent.parts == (Part("a", "a:1", "", (0, 1), 0), Part("b", "b:1", "", (0, 1), 2))
    # Each server holds its part for the part's hello, the waiter's own server too.
    await sync(b)
    assert a.fleet is not None and b.fleet is not None
    assert all(s.state == LEASED and a.fleet.holds(s) for s in a.slots)
    assert all(s.state == LEASED and b.fleet.holds(s) for s in b.slots)
    parts = []
    for m, k in ((a, 0), (b, 1)):
        there = m.enqueue(_part(sent.group, k), "alice", client(2), redirectable=True)
        await sync(m)
        first = await asyncio.wait_for(there.future, 1)
        assert first is m.slots[0] and there.granted == m.slots
        parts.append(await m.begin(there, first, b"hello", 1, -1))
    # Each part is an ordinary lease on its server; its record names the group and its part.
    for m, lease, k in ((a, parts[0], 0), (b, parts[1], 1)):
        assert [s.lease for s in m.slots] == [lease, lease]
        assert m.store.spread[lease.id] == (sent.group, k, 2)  # type: ignore[attr-defined]
        assert m.store.started[lease.id].request == (  # type: ignore[attr-defined]
            f"2 GPUs, part {k} of 2 of spread lease {sent.group}")
    # A second hello for a part claimed already is refused, not left waiting for ever.
    again = b.enqueue(_part(sent.group, 1), "alice", client(2), redirectable=True)
    await sync(b)
    with pytest.raises(PartRefused, match=f"part 1 of the spread lease {sent.group} is already "
                       "claimed on server b"):
        await asyncio.wait_for(again.future, 1)
    assert again not in b.queue and [s.lease for s in b.slots] == [parts[1], parts[1]]


async def test_a_spread_request_one_server_serves_whole_is_a_lease_of_that_server(
        server: Server) -> None:  # noqa: F811
    a = await server("a", 2)
    b = await server("b", 2)
    await sync(b)
    # Its own server has the 2: granted there, no redirect (of one part, or any).
    w = a.enqueue(Requirements(gpus=2, spread=True), "alice", client(2), redirectable=True)
    await sync(a)
    first = await asyncio.wait_for(w.future, 1)
    assert first is a.slots[0] and w.granted == a.slots
    await a.begin(w, first, b"hello", 1, -1)
    # Only b has 2 free now: the ordinary redirect to one server (no parts), and the redirected
    # hello there gets its ticket back and the GPUs held for it.
    x = a.enqueue(Requirements(gpus=2, spread=True), "bob", client(3), redirectable=True)
    await sync(a)
    sent = await asyncio.wait_for(x.future, 1)
    assert isinstance(sent, Redirect) and (sent.server, sent.group, sent.parts) == ("b", 0, ())
    await sync(b)
    there = b.enqueue(Requirements(gpus=2, spread=True), "bob", client(3), redirectable=True)
    await sync(b)
    assert await asyncio.wait_for(there.future, 1) is b.slots[0] and there.granted == b.slots


def test_a_part_is_held_once_per_part_of_its_lease_at_most_a_cap() -> None:
    row = replace(waiter(1, "a"), state="assigned", spread=True)
    assert hold_seconds(row) == REDIRECT_CLAIM_S  # a lease of one server
    two = replace(row, parts=(("a", (0,)), ("b", (0,))))
    assert hold_seconds(two) == 2 * REDIRECT_CLAIM_S
    assert hold_seconds(replace(two, client={"connect_timeout_ms": 300})) == pytest.approx(0.6)
    many = replace(row, parts=tuple((f"s{i}", (0,)) for i in range(8)))
    assert hold_seconds(many) == SPREAD_CLAIM_MAX_S


async def test_each_server_holds_its_part_while_the_parts_connect_one_after_another(
        server: Server) -> None:  # noqa: F811
    a = await server("a", 2)
    b = await server("b", 2)
    await sync(b)
    w = a.enqueue(Requirements(gpus=4, spread=True), "alice", client(2), redirectable=True)
    await sync(a, b)
    sent = await asyncio.wait_for(w.future, 1)
    assert isinstance(sent, Redirect) and len(sent.parts) == 2
    for m in (a, b):
        assert m.fleet is not None
        (held,) = m.fleet._reservations.values()  # noqa: SLF001
        assert held.hold == 2 * REDIRECT_CLAIM_S
        assert held.until - time.monotonic() > REDIRECT_CLAIM_S  # past one part's claim


async def test_a_part_hello_is_not_refused_by_the_queue_limits(
        server: Server) -> None:  # noqa: F811
    a = await server("a", 2)
    b = await server("b", 2, max_queue=0)  # b's queue takes nobody
    await sync(b)
    w = a.enqueue(Requirements(gpus=4, spread=True), "alice", client(2), redirectable=True)
    await sync(a, b)
    sent = await asyncio.wait_for(w.future, 1)
    assert isinstance(sent, Redirect)
    with pytest.raises(QueueFull, match="max_queue = 0"):  # a new client waits nowhere
        b.enqueue(Requirements(), "bob", client(3), redirectable=True)
    # The part's hello only claims the GPUs held for it (the store decides): it is not queued.
    there = b.enqueue(_part(sent.group, 1), "alice", client(2), redirectable=True)
    await sync(b)
    assert await asyncio.wait_for(there.future, 1) is b.slots[0]


async def test_a_claimed_part_whose_lease_ended_elsewhere_is_no_sign_of_a_server_down(
        server: Server, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    a = await server("a", 2)
    assert a.fleet is not None
    part = a.enqueue(_part(999, 0), "alice", client(2), redirectable=True)
    plain = a.enqueue(Requirements(gpus=9), "bob", client(3), redirectable=True)
    # Both had a ticket the fleet queue no longer has (another server ended the spread lease;
    # the store dropped the plain waiter's row): only the plain waiter is counted as lost.
    a.fleet._tickets.update({part: 999, plain: 998})  # noqa: SLF001
    await sync(a)
    lost = [r.getMessage() for r in caplog.records if "had left the fleet queue" in r.message]
    assert lost == ["fleet queue: 1 waiter(s) of this server had left the fleet queue (this "
                    "server was marked down meanwhile): queued again"]


def test_a_hello_naming_a_spread_group_past_64_bits_is_refused_at_once() -> None:
    def hello(group: int) -> bytes:
        return gp.Hello(magic=gp.MAGIC, major=gp.MAJOR, minor=gp.MINOR, pid=7, host="h",
                        user="u", program="p", token="t", gpus=2, spread_group=group, part=1,
                        parts=2).encode()
    assert isinstance(parse_hello(hello(MAX_SPREAD_GROUP)), gp.Hello)
    got = parse_hello(hello(MAX_SPREAD_GROUP + 1))
    assert isinstance(got, Refusal) and got.result == gp.GP_EPROTO
    assert f"spread_group {MAX_SPREAD_GROUP + 1} is above {MAX_SPREAD_GROUP}" in got.message


async def test_outside_a_fleet_a_hello_claims_no_part_and_its_lease_records_none(
        mgr: Any) -> None:  # noqa: F811
    m = await mgr(2, max_queue=0)
    # No fleet gave this client a spread lease: its hello's fields are only its word, and it is
    # an ordinary request for 2 GPUs.
    _, lease = await lease_on(m, 2, req=Requirements(gpus=2, spread_group=9, part=1, parts=2))
    view = lease_view(lease)
    assert (view["spread_group"], view["part"], view["parts"]) == (0, 0, 0)
    assert lease.id not in getattr(m.store, "spread", {})
    # nor does it skip the queue limits as a part's hello does in a fleet (max_queue = 0)
    with pytest.raises(QueueFull):
        m.enqueue(Requirements(gpus=2, spread_group=9, part=1, parts=2), "alice", client(4))
    assert "spread" not in m.store.started[lease.id].request  # type: ignore[attr-defined]


async def test_a_spread_waiter_waits_for_n_free_in_the_fleet_and_the_queue_says_so(
        server: Server) -> None:  # noqa: F811
    a = await server("a", 2)
    b = await server("b", 2)
    await leased(b, 5, "carol")  # 3 free in the fleet
    w = a.enqueue(Requirements(gpus=4, spread=True), "alice", client(2), redirectable=True)
    small = a.enqueue(Requirements(), "bob", client(3), redirectable=True)
    await sync(a, b, a)
    assert not w.future.done() and not small.future.done()  # the 3 are held back for alice
    assert a.fleet is not None
    assert [(q["token"], q["request"]) for q in fleet_queue(a.fleet, None, "a")] == [  # type: ignore[arg-type]
        ("alice", "4 GPUs (spread)"), ("bob", "any GPU")]
    await ended(b, 0)  # the 4th is free: alice gets all 4 at once, in two parts
    await sync(b, a)
    sent = await asyncio.wait_for(w.future, 1)
    assert isinstance(sent, Redirect) and [p.server for p in sent.parts] == ["a", "b"]
    assert not small.future.done()


async def test_a_part_never_claimed_is_let_go_and_the_other_parts_with_it(
        server: Server) -> None:  # noqa: F811
    a = await server("a", 2)
    b = await server("b", 2)
    await sync(b)
    late = replace(client(2), connect_timeout_ms=300)  # each of 2 parts held 2 * 0.3 s
    w = a.enqueue(Requirements(gpus=4, spread=True), "alice", late, redirectable=True)
    await sync(a, b)
    sent = await asyncio.wait_for(w.future, 1)
    assert isinstance(sent, Redirect) and len(sent.parts) == 2
    # Part 0 is claimed on a; part 1 never arrives at b.
    mine = a.enqueue(_part(sent.group, 0), "alice", late, redirectable=True)
    await sync(a)
    assert await asyncio.wait_for(mine.future, 1) is a.slots[0]
    await asyncio.sleep(0.65)
    await sync(b)  # past its hold: b's part is free again
    assert [s.state for s in b.slots] == [FREE, FREE]
    await sync(b)  # (the ticket finished: its row is gone)
    # Its hello coming after all is refused, with what happened and what to do.
    there = b.enqueue(_part(sent.group, 1), "alice", late, redirectable=True)
    await sync(b)
    with pytest.raises(PartRefused, match="no longer held on server b.*run the program again"):
        await asyncio.wait_for(there.future, 1)
    assert there not in b.queue
    # b's GPUs serve the next waiter.
    nxt = b.enqueue(Requirements(gpus=2), "bob", client(3))
    await sync(b, b)
    assert await asyncio.wait_for(nxt.future, 1) is b.slots[0]


async def test_a_held_part_is_let_go_when_another_part_was_not_claimed(
        server: Server) -> None:  # noqa: F811
    a = await server("a", 2)
    b = await server("b", 2)
    await leased(b, 5, "carol")  # b: 1 free; a: 2 free; alice asks for 3
    late = replace(client(2), connect_timeout_ms=300)
    w = a.enqueue(Requirements(gpus=3, spread=True), "alice", late, redirectable=True)
    await sync(a, b)
    sent = await asyncio.wait_for(w.future, 1)
    assert isinstance(sent, Redirect)
    assert [(p.server, p.gpus, p.first_device) for p in sent.parts] == [
        ("a", (0, 1), 0), ("b", (1,), 2)]
    await asyncio.sleep(0.65)
    await sync(b, b)  # b's part let go, the ticket over
    await sync(a)  # a's part let go with it (no need to wait for its own hold)
    assert [s.state for s in a.slots] == [FREE, FREE]


# ---------------------------------------------------------------------------------- end to end
def _hello(to: Any, token: str, **kw: Any) -> gp.HelloReply:
    """A 1.8 hello on plain TCP to server `to`; its reply (queue notices skipped), the socket
    kept open in `_open` (a granted part's lease lasts while it is)."""
    s = socket.create_connection((to.host, to.port), timeout=20)
    _open.append(s)
    s.sendall(gp.encode_frame(gp.Hello(
        magic=gp.MAGIC, major=gp.MAJOR, minor=gp.MINOR, pid=4242, host="spread-host",
        user="tester", program="test_fleet_spread", token=token, **kw), 1))
    while True:
        frame = read_frame(s)
        if frame.flags & gp.FLAG_REPLY:
            return gp.HelloReply.decode(frame.body)


_open: list[socket.socket] = []


def test_two_real_servers_give_a_spread_lease_of_4_in_two_parts(
        start_daemon: Any, native_build: Path, pg_url: str) -> None:
    """Two gpupoold --simulated 2 on one PostgreSQL: a hello for 4 GPUs with GP_HELLO_SPREAD is
    answered with its two parts (A's first, device order), and each part's hello, at its
    server, is answered by a worker of 2 devices; each part's lease record names the group."""
    a, b = (start_daemon("--database", pg_url, simulated=2, build_dir=native_build, tls=False)
            for _ in range(2))
    wait_until("A sees the fleet's 4 GPUs",
               lambda: [(v["state"], len(v["gpus"])) for v in a.get_json("/api/v1/fleet")[
                   "servers"]] == [("up", 2), ("up", 2)])
    try:
        sent = _hello(a, a.token, flags=gp.GP_HELLO_SPREAD, gpus=4, va_base=VA_BASE,
                      va_size=VA_SIZE)
        assert sent.result == gp.GP_EREDIRECT and sent.spread_group > 0, sent.message
        addr = {s: f"{s.host}:{s.port}" for s in (a, b)}
        assert [(p.server, p.gpus, p.first_device) for p in sent.redirect_parts] == [
            (addr[a], 2, 0), (addr[b], 2, 2)], sent.message
        for k, there in enumerate((a, b)):  # each part its own slice of the address window
            got = _hello(there, a.token, gpus=2, spread_group=sent.spread_group, part=k,
                         parts=2, va_base=VA_BASE + k * VA_SIZE // 2, va_size=VA_SIZE // 2)
            assert (got.result, got.device_count) == (0, 2), got.message
        # Each part is a lease of its server; the records (one store) link the parts.
        leases = a.get_json("/api/v1/leases")["leases"]
        assert sorted((le["spread_group"], le["part"], le["parts"], len(le["gpus"]))
                      for le in leases) == [(sent.spread_group, k, 2, 2) for k in (0, 1)]
        assert len({le["server"] for le in leases}) == 2
        # A part's hello that names a part held elsewhere is refused, and says where.
        wrong = _hello(b, a.token, gpus=2, spread_group=sent.spread_group, part=0, parts=2,
                       va_base=VA_BASE, va_size=VA_SIZE // 2)
        assert wrong.result == gp.GP_EREFUSED and "not on this one" in wrong.message
    finally:
        while _open:
            _open.pop().close()
