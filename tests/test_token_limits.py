"""A token's limits in the lease manager (pool/leases.py, pool/detach.py, pool/state.py's `held`)
with fake workers, checkpoints, store and cleaner: `max_gpus_per_token` counts a token's detached
leases too, a waiter that its own token's limit holds back makes no idle lease detach, a detached
lease coming back takes its own place back and waits when its token holds more than the limit,
and `max_queue_per_token` refuses one token's further waiters without touching the others'
(issue 29). The end-to-end test is tests/test_e2e_token_limits.py."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import replace
from typing import Any

import pytest
from test_detach import detaching, until
from test_leases import client, lease_on, mgr, settle  # noqa: F401

from gpupoold.pool.fleet import match
from gpupoold.pool.leases import FREE, QueueFull
from gpupoold.pool.requirements import Requirements
from gpupoold.pool.slots import ATTACHED, DETACHED
from gpupoold.pool.waitqueue import WaitQueue
from gpupoold.store.database import StoreDB
from gpupoold.store.fleet import GpuRow, QueueRow, SyncInput


async def test_a_detached_lease_counts_toward_its_token_limit(mgr: Any) -> None:  # noqa: F811
    m = await detaching(mgr, 2, detach_policy="always", max_gpus_per_token=1)
    _, lease = await lease_on(m, 1, token="alice")
    await until("detached", lambda: lease.state == DETACHED)
    await until("GPU 0 free", lambda: m.slots[0].state == FREE)
    assert m.pool.held("alice") == 1 and m.pool.held("alice", but=lease.id) == 0
    second = m.enqueue(Requirements(), "alice", client(2))
    await asyncio.sleep(0.2)
    assert not second.future.done(), "alice's detached lease holds her one GPU"
    assert m.counts(Requirements(), "alice")[2] == 0  # the info reply: nothing free for her
    bob = m.enqueue(Requirements(), "bob", client(3))
    await asyncio.wait_for(bob.future, 1)
    # Her detached lease ends: the limit lets her next client in.
    lease.worker.finish("client exit")
    await asyncio.wait_for(second.future, 1)
    assert m.pool.held("alice") == 1


async def test_a_waiter_its_own_limit_holds_back_makes_no_lease_detach(mgr: Any) -> None:  # noqa: F811
    m = await detaching(mgr, 1, max_gpus_per_token=1)  # policy when-queued
    _, lease = await lease_on(m, 1, token="alice")
    second = m.enqueue(Requirements(), "alice", client(2))
    await asyncio.sleep(0.4)
    assert lease.worker.asked == 0 and lease.state == ATTACHED and not second.future.done()
    # Another token's waiter may take the GPU: the idle lease gives it back for her.
    bob = m.enqueue(Requirements(), "bob", client(3))
    slot = await asyncio.wait_for(bob.future, 3)
    assert slot is m.slots[0] and lease.state == DETACHED
    # Alice's second client still waits: her detached lease holds her one GPU.
    await m.begin(bob, slot, b"hello", 1, -1)
    await asyncio.sleep(0.2)
    assert not second.future.done() and m.pool.held("alice") == 1


async def test_a_returning_lease_takes_its_own_place_back(mgr: Any) -> None:  # noqa: F811
    m = await detaching(mgr, 1, detach_policy="always", max_gpus_per_token=1)
    _, lease = await lease_on(m, 1, token="alice")
    await until("detached", lambda: lease.state == DETACHED)
    waiting = m.enqueue(Requirements(), "alice", client(2))  # held back by the detached lease
    lease.worker.wants_gpu.set()
    await until("A attached", lambda: lease.state == ATTACHED)
    assert lease.slot is m.slots[0] and not waiting.future.done()


async def test_a_returning_lease_waits_while_its_token_holds_more_than_the_limit(mgr: Any) -> None:  # noqa: F811
    m = await detaching(mgr, 2, detach_policy="always", max_gpus_per_token=2)
    _, lease = await lease_on(m, 1, token="alice")
    await until("detached", lambda: lease.state == DETACHED)
    await until("GPU 0 free", lambda: m.slots[0].state == FREE)
    _, other = await lease_on(m, 2, token="alice")
    other.keep_gpu = "test: stays"
    # The operator lowered the limit to 1 (a reload): alice holds 2, the returning lease waits
    # (a free GPU is there) until her other lease ends, then takes its place back.
    m.settings = replace(m.settings, max_gpus_per_token=1)
    lease.worker.wants_gpu.set()
    await asyncio.sleep(0.3)
    assert lease.slot is None and [w.returning for w in m.queue] == [lease.id]
    other.worker.finish("client exit")
    await until("A attached", lambda: lease.state == ATTACHED)


async def test_max_queue_per_token_refuses_one_token_and_not_the_others(mgr: Any) -> None:  # noqa: F811
    m = await mgr(1, max_queue_per_token=2, max_queue=10, queue_timeout=60.0)
    await lease_on(m, 1, token="carol")
    first = m.enqueue(Requirements(), "alice", client(2))
    m.enqueue(Requirements(), "alice", client(3))
    with pytest.raises(QueueFull, match=r"this token already has 2 clients waiting for one "
                       r"\(max_queue_per_token = 2\); try again when one of them has its GPU "
                       r"or has left: each waits at most queue_timeout = 60 s"):
        m.enqueue(Requirements(), "alice", client(4))
    assert m.counters.get("admission_refused", reason="queue_per_token") == 1
    bob = m.enqueue(Requirements(), "bob", client(5))  # another token still queues
    assert [w.token for w in m.queue] == ["alice", "alice", "bob"]
    m.abandon(first)
    m.enqueue(Requirements(), "alice", client(6))  # a place of hers came free
    await settle()
    assert m.queue.position(bob) == 2
    with pytest.raises(QueueFull):
        m.enqueue(Requirements(), "alice", client(7))
    assert m.counters.get("admission_refused", reason="queue_per_token") == 2
    assert m.counters.get("admission_refused", reason="queue") == 0


async def test_max_queue_is_counted_apart_and_zero_per_token_means_no_limit_of_its_own(mgr: Any) -> None:  # noqa: F811
    m = await mgr(1, max_queue_per_token=0, max_queue=3)
    await lease_on(m, 1, token="carol")
    for n in range(3):
        m.enqueue(Requirements(), "alice", client(10 + n))
    with pytest.raises(QueueFull, match=r"the queue is full \(3 waiting, max_queue = 3\)"):
        m.enqueue(Requirements(), "bob", client(20))
    assert m.counters.get("admission_refused", reason="queue") == 1


async def test_one_tokens_many_waiters_do_not_keep_another_tokens_client_behind_them(mgr: Any) -> None:  # noqa: F811
    """The queue's turn is by token, least recently served first: alice holds the one GPU and
    queues five more clients; bob's one client, queued after them, is next, so it waits no
    longer than alice's holder (issue 29's acceptance)."""
    m = await mgr(1, max_queue_per_token=8, queue_timeout=60.0)
    _, holder = await lease_on(m, 1, token="alice")
    hers = [m.enqueue(Requirements(), "alice", client(10 + n)) for n in range(5)]
    bob = m.enqueue(Requirements(), "bob", client(20))
    assert m.queue.position(bob) == 1 and [m.queue.position(w) for w in hers] == [2, 3, 4, 5, 6]
    assert [v["token"] for v in m.queue.view()] == ["bob"] + ["alice"] * 5  # the views' order
    holder.worker.finish("client exit")
    slot = await asyncio.wait_for(bob.future, 3)
    assert slot is m.slots[0] and not any(w.future.done() for w in hers)


async def test_the_turn_goes_round_the_tokens_and_a_served_token_goes_to_the_back() -> None:
    queue = WaitQueue()
    a1, a2 = (queue.join(Requirements(), "alice", client(n)) for n in (1, 2))
    b1, b2 = (queue.join(Requirements(), "bob", client(n)) for n in (3, 4))
    c1 = queue.join(Requirements(), "carol", client(5))
    # nobody served yet: rounds in the order their first clients came
    assert queue.in_turn() == [a1, b1, c1, a2, b2]
    assert queue.first(lambda w: w.token != "alice") is b1
    queue.granted(a1)
    assert queue.in_turn() == [b1, c1, a2, b2]
    queue.granted(c1)  # carol served before bob (bob's client could not take that GPU)
    assert queue.in_turn() == [b1, a2, b2]
    queue.granted(b1)
    assert queue.in_turn() == [a2, b2]  # alice was served longest ago
    a3 = queue.join(Requirements(), "alice", client(6))
    assert queue.in_turn() == [a2, b2, a3] and queue.position(a3) == 3
    queue.leave(a2)  # giving up is not being served: alice keeps her turn
    assert queue.in_turn() == [a3, b2]


def test_the_fleets_turn_puts_a_token_holding_gpus_after_one_holding_none() -> None:
    gpus = [gpu("a", 0, token="t"), gpu("b")]
    queue = [waiter(1, "a", "t"), waiter(2, "a", "t"), waiter(3, "b", "u"), waiter(4, "a", "t")]
    assert match(gpus, queue, UP) == [(3, "b", 0)]
    # among equals, ticket order
    assert match([gpu("a"), gpu("b")], queue, UP) == [(1, "a", 0), (3, "b", 0)]


# ------------------------------------------------------------------------------- in a fleet
UP = {"a", "b"}


def gpu(server: str, index: int = 0, token: str = "") -> GpuRow:
    return GpuRow(server=server, index=index, uuid=f"GPU-{server}-{index}", name="H100",
                  memory_total=80 << 30, simulated=True, state="leased" if token else "free",
                  free=not token, lease_id=1 if token else None, token=token, updated=0.0)


def waiter(ticket: int, server: str, token: str,
           only: tuple[int, ...] | None = None) -> QueueRow:
    return QueueRow(ticket=ticket, server=server, token=token, client={"host": "h", "pid": ticket},
                    request={"gpu": "", "model": "", "min_memory": 0}, only=only,
                    redirectable=only is None, joined=0.0, state="waiting")


def test_the_fleet_counts_a_tokens_detached_leases_on_any_server() -> None:
    gpus = [gpu("a"), gpu("b")]
    queue = [waiter(1, "a", "t"), waiter(2, "b", "u")]
    assert match(gpus, queue, UP, 1) == [(1, "a", 0), (2, "b", 0)]
    # t's lease detached on b: t holds its one GPU; u is served meanwhile.
    assert match(gpus, queue, UP, 1, Counter({"t": 1})) == [(2, "b", 0)]
    # That lease coming back (only GPU 0 of b) takes its own place back...
    back = [waiter(1, "a", "t"), waiter(3, "b", "t", only=(0,))]
    assert match(gpus, back, UP, 1, Counter({"t": 1})) == [(3, "b", 0)]
    # ...and waits while t holds more than the limit otherwise (its GPU on a).
    busy = [gpu("a", token="t"), gpu("b")]
    assert match(busy, back, UP, 1, Counter({"t": 1})) == []
    assert match(busy, back, UP, 2, Counter({"t": 1})) == [(3, "b", 0)]


def test_the_store_shares_each_servers_detached_leases_with_the_fleet(pg_url: str) -> None:
    dbs = {name: StoreDB(pg_url, server=name) for name in ("a", "b")}
    try:
        for db in dbs.values():
            db.server_up("127.0.0.1:1", "127.0.0.1:2", time.time())

        def sync(name: str, waiters: list[tuple[int, QueueRow]], away: list[tuple[int, str]]) -> Any:
            return dbs[name].fleet_sync(
                SyncInput(name, [gpu(name)], waiters, away=away),
                lambda g, q, up, held_away: match(g, q, up, 1, held_away))

        # a has t's detached lease 7; b's waiter of t gets nothing, b's waiter of u gets b's GPU.
        res = sync("a", [], [(7, "t")])
        assert res.away == [("a", "t")]
        res = sync("b", [(1, waiter(0, "b", "t")), (2, waiter(0, "b", "u"))], [])
        (t_ticket, u_ticket) = (res.tickets[1], res.tickets[2])
        assert [(ticket, server) for ticket, server, _ in res.assigned] == [(u_ticket, "b")]
        # Lease 7 ended: a's next sync drops it, and t's waiter may take a's GPU.
        res = sync("a", [], [])
        assert res.away == [] and [(t, s) for t, s, _ in res.assigned] == [(t_ticket, "a")]
    finally:
        for db in dbs.values():
            db.close()


def test_a_server_counts_the_others_as_of_the_last_sync_and_itself_as_it_is() -> None:
    from types import SimpleNamespace

    from test_leases import make_gpu

    from gpupoold.pool.events import EventBus
    from gpupoold.pool.fleet import FleetQueue
    from gpupoold.pool.state import PoolState
    from gpupoold.pool.waitqueue import WaitQueue
    from gpupoold.store.fleet import SyncResult

    pool = PoolState([make_gpu(0)], EventBus())
    fq = FleetQueue(pool, WaitQueue(), SimpleNamespace(server="a"), 1,  # type: ignore[arg-type]
                    grant=lambda s, w: None, claim=lambda s, w: None, release=lambda s: None,
                    closing=lambda: False)
    assert fq.under_limit("t")  # no sync yet: this server's count only
    fq.last = SyncResult(tickets={}, gpus=[gpu("a", token="x"), gpu("b", token="t")], queue=[],
                         servers={"a": {"state": "up"}, "b": {"state": "up"}}, assigned=[],
                         away=[("b", "u"), ("a", "v")])
    # t holds b's GPU, u has a lease detached on b: both at the limit. This server's own rows
    # of the last sync (x on GPU 0, v away) are not counted: its pool says what it holds now.
    assert not fq.under_limit("t") and not fq.under_limit("u")
    assert fq.under_limit("x") and fq.under_limit("v") and fq.under_limit("w")
    fq.last.servers["b"]["state"] = "down"  # a down server's GPUs and leases are gone
    assert fq.under_limit("t") and fq.under_limit("u")
