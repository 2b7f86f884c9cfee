"""A lease of several GPUs in a fleet (issue 37, items 1 and 3's ground): a client asking for
GPUPOOL_GPUS=N is given N GPUs of ONE server at once by the fleet's match (pool/fleet.py), head of
line as on one server, never some now and the rest later; sent to another server's N GPUs, it
finds them all held there and claims them together, and a client that never arrives frees all
of them. First the decisions alone (`match`), then two lease managers sharing a real PostgreSQL
(the `server` fixture of test_fleet_one_queue.py: fake workers, the real fleet queue and store).
End to end, between servers with their own addresses (a redirect must name B's address, which
loopback cannot tell from A's): tests/test_fleet_netns.py, where a GPUPOOL_GPUS=2 client of a
busy A gets 2 devices of one worker on B, bit-exact on each and across a peer copy."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest
from test_fleet import gpu, waiter
from test_fleet_one_queue import Server, leased, server, sync  # noqa: F401  (server: a fixture)
from test_leases import client

from gpupoold.pool.fleet import Redirect, match
from gpupoold.pool.fleet_view import fleet_queue
from gpupoold.pool.leases import LeaseManager
from gpupoold.pool.requirements import Requirements
from gpupoold.pool.slots import FREE, LEASED
from gpupoold.store.database import StoreDB
from gpupoold.store.fleet import GpuRow, QueueRow, SyncInput

UP = {"a", "b", "c"}


def wants(ticket: int, where: str, n: int, **kw: object) -> QueueRow:
    return replace(waiter(ticket, where, **kw), gpus=n)  # type: ignore[arg-type]


def drained(row: GpuRow) -> GpuRow:
    return replace(row, state="drained", free=False)


# ----------------------------------------------------------------------------- the decisions
def test_n_gpus_come_from_one_server_its_own_first_then_the_first_with_n_free() -> None:
    gpus = [gpu("a"), gpu("a", 1), gpu("b"), gpu("b", 1)]
    assert match(gpus, [wants(1, "b", 2)], UP) == [(1, "b", 0), (1, "b", 1)]
    assert match(gpus, [wants(1, "c", 2)], UP) == [(1, "a", 0), (1, "a", 1)]
    # One free on a, two on b, one on c: a waiter of a for 2 is sent to b, both of b's.
    gpus = [gpu("a"), gpu("a", 1, free=False), gpu("b"), gpu("b", 1), gpu("c")]
    assert match(gpus, [wants(1, "a", 2)], UP) == [(1, "b", 0), (1, "b", 1)]


def test_never_fewer_than_n_nor_more_nor_from_two_servers() -> None:
    gpus = [gpu("a"), gpu("a", 1, free=False), gpu("b"), gpu("b", 1, free=False), gpu("c")]
    assert match(gpus, [wants(1, "a", 2)], UP) == []  # 3 free in the fleet, 1 per server
    gpus = [gpu("a", i) for i in range(4)]
    assert match(gpus, [wants(1, "a", 3), wants(2, "a", 2)], UP) == [
        (1, "a", 0), (1, "a", 1), (1, "a", 2)]  # the 4th is free, and 2 holds it back for itself


def test_a_waiter_for_n_holds_back_the_free_gpus_of_the_server_nearest_to_serving_it() -> None:
    # a: 2 GPUs, 1 free; b: 1 GPU, free. The waiter for 2 can only be served on a: a's free GPU
    # waits for it (a 1-GPU waiter behind it is sent to b's instead, and one more waits).
    gpus = [gpu("a"), gpu("a", 1, free=False), gpu("b")]
    queue = [wants(1, "a", 2), waiter(2, "a"), waiter(3, "a")]
    assert match(gpus, queue, UP) == [(2, "b", 0)]
    # a's second GPU freed: the waiter for 2 gets both at once, before the one ahead of 3.
    gpus = [gpu("a"), gpu("a", 1), gpu("b", free=False, holder=2)]
    assert match(gpus, queue[::2], UP) == [(1, "a", 0), (1, "a", 1)]
    # a: 3 GPUs, 1 free; b: 3 GPUs, 2 free. A waiter of a for 3 waits for b's (the most free:
    # nearest), and a's free GPU serves the waiter behind it.
    gpus = [gpu("a"), gpu("a", 1, free=False), gpu("a", 2, free=False),
            gpu("b"), gpu("b", 1), gpu("b", 2, free=False)]
    assert match(gpus, [wants(1, "a", 3), waiter(2, "b"), waiter(3, "b")], UP) == [
        (2, "a", 0)]


def test_a_waiter_no_server_can_serve_now_holds_nothing_back() -> None:
    # a's second GPU drained since the waiter for 2 joined, b has one GPU: nobody could serve it
    # until an operator acts, so the free GPUs serve the waiters behind it.
    gpus = [gpu("a"), drained(gpu("a", 1)), gpu("b")]
    assert match(gpus, [wants(1, "a", 2), waiter(2, "a"), waiter(3, "a")], UP) == [
        (2, "a", 0), (3, "b", 0)]
    # A waiter for 2 that may not leave its server (only its GPUs) holds back nothing elsewhere.
    gpus = [gpu("a"), gpu("a", 1, free=False), gpu("b"), gpu("b", 1, free=False)]
    assert match(gpus, [wants(1, "a", 2, redirectable=False), waiter(2, "b")], UP) == [
        (2, "b", 0)]


def test_max_gpus_per_token_counts_the_n_asked_for() -> None:
    gpus = [gpu("a", free=False, token="t"), gpu("b"), gpu("b", 1), gpu("c"), gpu("c", 1)]
    queue = [wants(1, "a", 2), wants(2, "a", 2, token="u")]
    assert match(gpus, queue, UP, 2) == [(2, "b", 0), (2, "b", 1)]  # t holds 1: 1 + 2 > 2
    # Under 3 both are served; u first (it holds nothing: the fleet's turn, `in_turn`).
    assert match(gpus, queue, UP, 3) == [(2, "b", 0), (2, "b", 1), (1, "c", 0), (1, "c", 1)]


# ----------------------------------------------------------- two servers sharing one store
async def test_a_waiter_for_2_is_sent_to_the_server_with_2_free_and_claims_both_there(
        server: Server) -> None:  # noqa: F811
    a = await server("a", 2)
    b = await server("b", 2)
    await leased(a, 1)  # one of a's two GPUs busy: a has not 2 free
    await sync(b)
    w = a.enqueue(Requirements(gpus=2), "alice", client(2), redirectable=True)
    await sync(a)
    sent = await asyncio.wait_for(w.future, 1)
    assert isinstance(sent, Redirect) and (sent.server, sent.gpu) == ("b", 0)
    assert a.slots[1].state == FREE  # a's free GPU was not taken for it meanwhile
    assert a.fleet is not None and a.fleet.last is not None
    row = next(q for q in a.fleet.last.queue if q.ticket == max(q.ticket for q in
                                                                  a.fleet.last.queue))
    assert (row.gpus, row.assigned_server, row.assigned_gpus) == (2, "b", (0, 1))
    await sync(b)  # b holds both for alice
    assert b.fleet is not None
    assert all(s.state == LEASED and b.fleet.holds(s) for s in b.slots)
    # Her redirected hello (the same token, host and pid) gets both at once.
    there = b.enqueue(Requirements(gpus=2), "alice", client(2), redirectable=True)
    await sync(b)
    first = await asyncio.wait_for(there.future, 1)
    assert first is b.slots[0] and there.granted == b.slots
    assert not any(b.fleet.holds(s) for s in b.slots)
    lease = await b.begin(there, first, b"hello", 1, -1)
    assert [s.lease for s in b.slots] == [lease, lease]


async def test_gpus_held_for_a_client_that_never_arrives_are_all_freed(server: Server) -> None:  # noqa: F811,E501
    a = await server("a", 1)
    b = await server("b", 2)
    await leased(a, 1)
    await sync(b)
    late = replace(client(2), connect_timeout_ms=300)  # held 0.3 s for it
    w = a.enqueue(Requirements(gpus=2), "alice", late, redirectable=True)
    await sync(a)
    assert isinstance(await asyncio.wait_for(w.future, 1), Redirect)
    await sync(b)
    assert b.fleet is not None and all(b.fleet.holds(s) for s in b.slots)
    await asyncio.sleep(0.35)
    await sync(b)  # past the deadline: both free again, together
    assert [s.state for s in b.slots] == [FREE, FREE]
    assert not any(b.fleet.holds(s) for s in b.slots)
    nxt = b.enqueue(Requirements(gpus=2), "bob", client(3))
    await sync(b, b)
    assert await asyncio.wait_for(nxt.future, 1) is b.slots[0] and nxt.granted == b.slots


async def test_head_of_line_in_the_fleet_gpus_freed_one_by_one_gather_for_the_waiter_of_2(
        server: Server) -> None:  # noqa: F811
    a = await server("a", 2)
    b = await server("b", 1)
    await leased(a, 1, "carol")
    await leased(a, 2, "dave")
    await leased(b, 3, "erin")
    big = a.enqueue(Requirements(gpus=2), "alice", client(4), redirectable=True)
    small = a.enqueue(Requirements(), "bob", client(5), redirectable=True)
    await sync(a, b)
    await ended(a, 0)
    await sync(a, b)
    assert not big.future.done() and not small.future.done()  # a's free GPU waits for alice
    await ended(b, 0)  # b's GPU cannot serve alice (b has 1): bob is sent there
    await sync(b, a)
    assert isinstance(await asyncio.wait_for(small.future, 1), Redirect)
    assert not big.future.done() and a.slots[0].state == FREE
    await ended(a, 1)  # a's second GPU freed: alice gets both at once
    await sync(a)
    assert await asyncio.wait_for(big.future, 1) is a.slots[0] and big.granted == a.slots


async def ended(m: LeaseManager, index: int) -> None:
    """The lease on GPU `index` of `m` ends (its client left); the GPU is free again after its
    (fake) scrub."""
    lease = m.slots[index].lease
    assert lease is not None
    lease.worker.finish("client disconnected")
    for _ in range(200):
        if m.slots[index].state == FREE:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"GPU {index} not free again: {m.slots[index].state}")


async def test_a_request_no_server_of_the_fleet_can_serve_is_refused_with_counts(
        server: Server) -> None:  # noqa: F811
    a = await server("a", 2)
    b = await server("b", 3, max_gpus_per_token=3)
    await sync(b, a)
    assert a.feasible(Requirements(gpus=3), redirectable=True) is None  # b has 3
    why = a.feasible(Requirements(gpus=4), redirectable=True)
    assert why is not None and "no live server of the fleet has 4" in why
    assert "this one has 2, the largest other live server, b, has 3" in why
    assert "ask for at most 3" in why
    why = a.feasible(Requirements(gpus=3))  # a client that is not sent elsewhere
    assert why is not None and "ask for at most 2" in why
    why = b.feasible(Requirements(gpus=4), redirectable=True)
    assert why is not None and "max_gpus_per_token" in why  # b lends a token 3 at most
    started = time.monotonic()
    assert b.feasible(Requirements(gpus=2, model="A100"), redirectable=True) is not None
    assert time.monotonic() - started < 5  # (at once: no waiting in the queue)


@pytest.mark.parametrize("limit", [2])
async def test_max_gpus_per_token_counts_n_in_the_fleet(server: Server, limit: int) -> None:  # noqa: F811,E501
    a = await server("a", 1, max_gpus_per_token=limit)
    b = await server("b", 2, max_gpus_per_token=limit)
    await leased(a, 1, "alice")  # alice holds 1 in the fleet
    await sync(b, a)
    assert a.fleet is not None and not a.fleet.under_limit("alice", need=2)
    w = a.enqueue(Requirements(gpus=2), "alice", client(2), redirectable=True)
    other = a.enqueue(Requirements(gpus=2), "bob", client(3), redirectable=True)
    await sync(a, b, a)
    assert not w.future.done()  # 1 + 2 > 2: alice waits
    # The fleet's queue (GET /api/v1/fleet, the dashboard's Fleet page) says what she waits for.
    assert [(q["token"], q["request"]) for q in fleet_queue(a.fleet, None, "a")] == [  # type: ignore[arg-type]
        ("alice", "2 GPUs")]
    assert isinstance(await asyncio.wait_for(other.future, 1), Redirect)  # bob does not


def test_a_detached_lease_of_2_counts_2_toward_the_fleets_token_limit(pg_url: str) -> None:
    db = StoreDB(pg_url, server="a")
    try:
        db.server_up("127.0.0.1:1", "127.0.0.1:2", time.time())
        waiting = [(1, wants(0, "a", 1)), (2, wants(0, "a", 1, token="u"))]
        res = db.fleet_sync(SyncInput("a", [gpu("a"), gpu("a", 1)], waiting, away=[(7, "t")],
                                      away_gpus={7: 2}),
                            lambda g, q, up, away: match(g, q, up, 2, away))
        assert res.away == [("a", "t"), ("a", "t")]
        # t's lease of 2 is away: t is at the limit of 2, its new waiter waits; u's does not.
        assert [ticket for ticket, _, _ in res.assigned] == [res.tickets[2]]
    finally:
        db.close()
