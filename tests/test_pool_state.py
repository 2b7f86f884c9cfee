"""The pool's state owner (gpupoold/pool/state.py): every transition from every state, taken
where the diagram has the edge and refused (nothing changed, nothing published) everywhere
else, and what each one links, unlinks and publishes. The expected edges are written out here,
apart from the module's own table, so a change to either one shows."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from test_leases import make_gpu

from gpupoold.gpu.cleaner import CleanResult
from gpupoold.pool.events import (
    EventBus,
    GpuChanged,
    GpuCleaned,
    LeaseAttached,
    LeaseDetached,
    LeaseEnded,
    LeaseGranted,
)
from gpupoold.pool.requirements import Requirements
from gpupoold.pool.slots import (
    ATTACHED,
    ATTACHING,
    DETACHED,
    DETACHING,
    DRAINED,
    FREE,
    LEASED,
    QUARANTINED,
    SCRUBBING,
    Lease,
    Slot,
)
from gpupoold.pool.state import LEASE_EDGES, SLOT_EDGES, PoolState, TransitionError, in_service
from gpupoold.pool.waitqueue import ClientInfo, Waiter
from gpupoold.workers.supervisor import WorkerStats

SLOT_STATES = (FREE, LEASED, SCRUBBING, QUARANTINED, DRAINED)
LEASE_STATES = (ATTACHED, DETACHING, DETACHED, ATTACHING)

# transition -> {state it may leave: state it reaches}; any other state refuses it.
EXPECTED_SLOT = {
    "restore": {SCRUBBING: QUARANTINED},  # (with a quarantine to restore)
    "adopt": {SCRUBBING: LEASED},
    "adopted": {LEASED: LEASED},
    "grant": {FREE: LEASED},
    "hold": {FREE: LEASED},
    "claim": {LEASED: LEASED},
    "reserve": {LEASED: LEASED},
    "release": {LEASED: FREE},
    "start": {LEASED: LEASED},
    "scrub": {LEASED: SCRUBBING, SCRUBBING: SCRUBBING, FREE: SCRUBBING, DRAINED: SCRUBBING},
    "scrubbed": {SCRUBBING: FREE},  # (a clean result)
    "evict": {LEASED: LEASED, SCRUBBING: SCRUBBING, FREE: FREE, DRAINED: DRAINED},
    "quarantine": {LEASED: QUARANTINED, SCRUBBING: QUARANTINED, FREE: QUARANTINED,
                   DRAINED: QUARANTINED},
    "clear": {QUARANTINED: SCRUBBING},
    "drain": {FREE: DRAINED, LEASED: LEASED, SCRUBBING: SCRUBBING, QUARANTINED: QUARANTINED,
              DRAINED: DRAINED},
    "undrain": {FREE: FREE, LEASED: LEASED, SCRUBBING: SCRUBBING, QUARANTINED: QUARANTINED,
                DRAINED: FREE},
    "grant_share": {FREE: LEASED, LEASED: LEASED},
    "start_share": {LEASED: LEASED},
    "release_share": {LEASED: LEASED},
    "adopted_shares": {LEASED: LEASED},
}
EXPECTED_LEASE = {
    "park": (ATTACHED, DETACHING),
    "unpark": (DETACHING, ATTACHED),
    "detach": (DETACHING, DETACHED),
    "recall": (DETACHED, ATTACHING),
    "attach": (ATTACHING, ATTACHED),
}


CLIENT = ClientInfo(host="h", user="u", pid=7, program="train.py", peer="10.0.0.2")


def waiter(ticket: int = 1) -> Waiter:
    return Waiter(ticket, Requirements(), "alice", CLIENT,
                  asyncio.get_running_loop().create_future())


def new_lease(lease_id: int = 5, slot: Slot | None = None) -> Lease:
    worker: Any = SimpleNamespace(pid=100, stats=WorkerStats())
    return Lease(id=lease_id, slot=slot, token="alice", client=CLIENT, req=Requirements(),
                 worker=worker, queued_s=0.5)


class Recorder:
    def __init__(self, bus: EventBus) -> None:
        self.seen: list[object] = []
        for kind in (GpuChanged, GpuCleaned, LeaseGranted, LeaseEnded, LeaseDetached,
                     LeaseAttached):
            bus.subscribe(kind, self.seen.append)


def pool_of(n: int = 2) -> tuple[PoolState, Recorder]:
    bus = EventBus()
    return PoolState([make_gpu(i) for i in range(n)], bus), Recorder(bus)


def fields(slot: Slot) -> tuple[Any, ...]:
    return (slot.state, slot.since, slot.lease, slot.reserved, slot.adopting, slot.draining,
            slot.quarantine, slot.last_scrub)


def slot_call(name: str, pool: PoolState, slot: Slot) -> Callable[[], object]:
    """The transition `name` on `slot`, its other preconditions than the state arranged (so the
    state alone decides whether it is taken)."""
    lease = new_lease()
    if name == "adopted":
        slot.adopting = lease.id
        return lambda: pool.adopted(slot, lease)
    if name == "adopted_shares":  # a previous daemon's share being taken over (issue 32)
        slot.adopting = lease.id
        lease.share = True
        return lambda: pool.adopted_shares(slot, [lease], closed=False)
    if name == "claim":
        slot.reserved = waiter(-3)
        return lambda: pool.claim(slot, waiter())
    if name == "start":
        slot.reserved = waiter()
        return lambda: pool.start(slot, lease)
    if name == "grant_share":  # a shared GPU leased to a share already (from leased)
        slot.shares = [new_lease(8, slot)]
        return lambda: pool.grant_share(slot, waiter())
    if name in ("start_share", "release_share"):
        w = waiter()
        slot.share_grants = [w]
        if name == "start_share":
            return lambda: pool.start_share(slot, w, lease)
        return lambda: pool.release_share(slot, w)
    calls: dict[str, Callable[[], object]] = {
        "restore": lambda: pool.restore(slot, False, {"reason": "XID 79"}),
        "adopt": lambda: pool.adopt(slot, 9),
        "grant": lambda: pool.grant(slot, waiter()),
        "hold": lambda: pool.hold(slot, waiter(-3)),
        "reserve": lambda: pool.reserve(slot, waiter()),
        "release": lambda: pool.release(slot),
        "scrub": lambda: pool.scrub(slot),
        "scrubbed": lambda: pool.scrubbed(slot, CleanResult(ok=True)),
        "evict": lambda: pool.evict(slot),
        "quarantine": lambda: pool.quarantine(slot, "stuck"),
        "clear": lambda: pool.clear(slot),
        "drain": lambda: pool.drain(slot),
        "undrain": lambda: pool.undrain(slot),
    }
    return calls[name]


def test_the_expected_edges_are_the_modules() -> None:
    assert {k: frozenset(v) for k, v in EXPECTED_SLOT.items()} == SLOT_EDGES
    assert EXPECTED_LEASE == LEASE_EDGES


@pytest.mark.parametrize("name", sorted(EXPECTED_SLOT))
@pytest.mark.parametrize("source", SLOT_STATES)
async def test_every_slot_transition_from_every_state(name: str, source: str) -> None:
    pool, rec = pool_of()
    slot = pool.slots[0]
    slot.state = source  # where the walk starts (a test may put it anywhere)
    call = slot_call(name, pool, slot)
    before = fields(slot)
    target = EXPECTED_SLOT[name].get(source)
    if target is None:
        with pytest.raises(TransitionError, match=f"no {name} from {source}"):
            call()
        assert fields(slot) == before and rec.seen == []
        return
    call()
    assert slot.state == target
    assert GpuChanged(0) in rec.seen  # every taken edge tells the views


@pytest.mark.parametrize("name", sorted(EXPECTED_LEASE))
@pytest.mark.parametrize("source", LEASE_STATES)
async def test_every_lease_transition_from_every_state(name: str, source: str) -> None:
    pool, rec = pool_of()
    slot = pool.slots[0]
    slot.state = LEASED
    lease = new_lease(slot=slot)
    lease.state = source
    if source in (DETACHED, ATTACHING):
        lease.slot, lease.home = None, slot.gpu
        slot.reserved = waiter()  # its GPU, granted to it again (for attach)
        slot.reserved.returning = lease.id
    else:
        slot.lease = lease
    calls: dict[str, Callable[[], object]] = {
        "park": lambda: pool.park(lease, 1024),
        "unpark": lambda: pool.unpark(lease),
        "detach": lambda: pool.detach(lease, 0.5),
        "recall": lambda: pool.recall(lease),
        "attach": lambda: pool.attach(lease, slot, 3.0, 0.01),
    }
    before = (lease.state, lease.state_since, lease.slot, slot.lease, lease.saved_bytes)
    source_ok, target = EXPECTED_LEASE[name]
    if source != source_ok:
        with pytest.raises(TransitionError, match=f"no {name} from {source}"):
            calls[name]()
        after = (lease.state, lease.state_since, lease.slot, slot.lease, lease.saved_bytes)
        assert after == before and rec.seen == []
        return
    calls[name]()
    assert lease.state == target and rec.seen


async def test_a_lease_starts_ends_and_is_counted_once() -> None:
    pool, rec = pool_of()
    slot = pool.slots[0]
    slot.state = FREE
    w = waiter()
    pool.grant(slot, w)
    assert (slot.state, slot.reserved, slot.holder()) == (LEASED, w, "alice")
    lease = new_lease()
    pool.start(slot, lease)
    assert slot.lease is lease and lease.slot is slot and slot.reserved is None
    assert pool.active() == [lease] and pool.lease(lease.id) is lease
    assert LeaseGranted(lease.id, 0, "alice", 0.5) in rec.seen
    with pytest.raises(TransitionError, match="a lease holds it"):
        pool.release(slot)  # a started lease's GPU is not a grant to give back
    with pytest.raises(TransitionError, match="holds it"):
        pool.scrub(slot)  # nor scrubbed under it
    pool.end(lease, "client exit", WorkerStats())
    assert pool.active() == [] and slot.lease is None and slot.state == LEASED
    ended = [e for e in rec.seen if isinstance(e, LeaseEnded)]
    assert len(ended) == 1 and ended[0].reason == "client exit" and ended[0].gpu == 0
    pool.scrub(slot)
    pool.scrubbed(slot, CleanResult(ok=True))
    assert slot.state == FREE and slot.last_scrub is not None and slot.last_scrub["ok"]
    assert any(isinstance(e, GpuCleaned) and e.ok for e in rec.seen)


async def test_release_and_scrubs_end_drained_while_draining_and_a_failed_scrub_quarantines(
) -> None:
    pool, _ = pool_of()
    slot = pool.slots[0]
    slot.state = FREE
    pool.grant(slot, waiter())
    pool.drain(slot)  # leased: drained once it is given back
    assert slot.state == LEASED and slot.draining and not in_service(slot)
    pool.release(slot)
    assert slot.state == DRAINED and slot.reserved is None
    pool.undrain(slot)
    assert slot.state == FREE and in_service(slot)
    pool.scrub(slot)
    pool.scrubbed(slot, CleanResult(ok=False, problems=["ECC errors"]))
    assert slot.state == QUARANTINED and slot.quarantine is not None
    assert slot.quarantine["reason"] == "ECC errors"
    assert pool.clear(slot) == "ECC errors" and slot.state == SCRUBBING and slot.quarantine is None


async def test_a_held_gpu_is_claimed_by_its_client_or_released() -> None:
    pool, _ = pool_of()
    slot = pool.slots[0]
    slot.state = FREE
    stand_in = waiter(-4)
    pool.hold(slot, stand_in)
    assert slot.state == LEASED and slot.reserved is stand_in
    w = waiter(8)
    pool.claim(slot, w)
    assert slot.reserved is w
    pool.release(slot)
    assert slot.state == FREE
    with pytest.raises(TransitionError, match="no claim from free"):
        pool.claim(slot, w)


async def test_a_lease_detaches_and_attaches_on_another_gpu() -> None:
    pool, rec = pool_of()
    home, other = pool.slots
    home.state = other.state = FREE
    pool.grant(home, waiter())
    lease = new_lease()
    pool.start(home, lease)
    pool.park(lease, 4096)
    assert lease.state == DETACHING and lease.saved_bytes == 4096 and lease.slot is home
    left = pool.detach(lease, 0.25)
    assert left == [home] and home.lease is None and lease.slot is None and lease.home is home.gpu
    assert (lease.state, lease.detaches) == (DETACHED, 1)
    assert LeaseDetached(lease.id, 0, 4096, 0.25) in rec.seen
    assert pool.active() == [lease]  # detached, still active
    pool.recall(lease)
    assert lease.state == ATTACHING
    w = waiter()
    w.returning = lease.id
    pool.grant(other, w)
    saved = pool.attach(lease, other, 2.0, 0.05)
    assert saved == 4096 and lease.saved_bytes == 0 and lease.detached_s == 2.0
    assert other.lease is lease and lease.slot is other and other.reserved is None
    assert LeaseAttached(lease.id, 1, True, 0.05, 4096) in rec.seen
    # A GPU not granted to it is refused: its old one (leased, no lease, before its scrub),
    # or one granted to another waiter.
    pool.park(lease, 1)
    pool.detach(lease, 0.1)
    pool.recall(lease)
    with pytest.raises(TransitionError, match="not granted to lease 5"):
        pool.attach(lease, other, 1.0, 0.01)
    pool.scrub(other)
    pool.scrubbed(other, CleanResult(ok=True))
    pool.grant(other, waiter())
    with pytest.raises(TransitionError, match="not granted to lease 5"):
        pool.attach(lease, other, 1.0, 0.01)
    assert lease.state == ATTACHING and other.lease is None


async def test_the_watchdog_evicts_and_quarantines() -> None:
    pool, _ = pool_of()
    slot = pool.slots[0]
    slot.state = FREE
    w = waiter()
    pool.grant(slot, w)
    lease = new_lease()
    pool.start(slot, lease)
    assert pool.evict(slot) == (lease, None) and pool.active() == [] and slot.lease is None
    slot2 = pool.slots[1]
    slot2.state = FREE
    pool.grant(slot2, waiter())
    other = new_lease(6)
    pool.start(slot2, other)
    assert pool.quarantine(slot2, "stuck for ever") is other
    assert slot2.state == QUARANTINED and slot2.quarantine is not None
    assert slot2.quarantine["problems"] == ["stuck for ever"] and pool.active() == []


async def test_start_up_restores_and_adopts() -> None:
    pool, _ = pool_of()
    a, b = pool.slots
    assert a.state == b.state == SCRUBBING  # every GPU's first scrub
    pool.restore(a, True, None)
    assert a.state == SCRUBBING and a.draining
    pool.adopt(b, 12)
    assert b.state == LEASED and b.adopting == 12
    wrong = new_lease(13)
    with pytest.raises(TransitionError, match="not taking over lease 13"):
        pool.adopted(b, wrong)
    lease = new_lease(12)
    pool.adopted(b, lease)
    assert b.adopting is None and b.lease is lease and pool.active() == [lease]


async def test_a_detached_lease_is_taken_over_on_no_gpu_and_comes_back_as_after_any_detach() -> None:
    pool, rec = pool_of()
    home, other = pool.slots
    other.state = FREE
    lease = new_lease(14)
    pool.adopted_detached(lease, home.gpu, 8192)
    assert (lease.state, lease.slot, lease.home, lease.saved_bytes) == (DETACHED, None, home.gpu,
                                                                         8192)
    assert pool.active() == [lease] and pool.away() == [lease] and pool.held("alice") == 1
    assert home.state == SCRUBBING and home.lease is None  # its GPU is scrubbed as any other
    assert GpuChanged(0) in rec.seen
    for bad in (lease, new_lease(15, slot=other)):  # active already; on a GPU
        with pytest.raises(TransitionError, match="no adopted_detached"):
            pool.adopted_detached(bad, home.gpu, 1)
    pool.recall(lease)
    w = waiter()
    w.returning = lease.id
    pool.grant(other, w)
    assert pool.attach(lease, other, 3.0, 0.02) == 8192
    assert lease.state == ATTACHED and other.lease is lease
    # Detached since its recorded detach, before the restart (a time in the future is not taken).
    again = new_lease(16)
    pool.adopted_detached(again, home.gpu, 1, since=time.time() - 60)
    assert pool.recall(again) >= 60
    later = new_lease(17)
    pool.adopted_detached(later, home.gpu, 1, since=time.time() + 60)
    assert later.state_since <= time.time()


async def test_a_shared_gpu_holds_several_shares_and_ends_with_the_last() -> None:
    """Issue 32: shares granted on a free GPU and on one leased to shares; the GPU is left for
    its whole scrub (ended_at) only when its last share ends; each share counts for its token."""
    pool, rec = pool_of(1)
    slot = pool.slots[0]
    slot.state = FREE
    a, b = waiter(1), waiter(2)
    pool.grant_share(slot, a)
    pool.grant_share(slot, b)
    assert slot.state == LEASED and slot.share_grants == [a, b]
    first, second = new_lease(5), new_lease(6)
    pool.start_share(slot, a, first)
    pool.start_share(slot, b, second)
    assert slot.shares == [first, second] and slot.lease is None and pool.active() == [first, second]
    assert pool.held("alice") == 1  # one GPU, as max_gpus_per_token counts
    with pytest.raises(TransitionError, match="leased whole"):
        other = pool_of(1)[0].slots[0]
        other.state, other.reserved = LEASED, waiter(3)
        pool.grant_share(other, waiter(4))
    pool.end(first, "client exit", WorkerStats())
    assert slot.shares == [second] and slot.ended_at is None
    pool.end(second, "client exit", WorkerStats())
    assert slot.shares == [] and slot.ended_at is not None and slot.state == LEASED
    assert [e.lease_id for e in rec.seen if isinstance(e, LeaseEnded)] == [5, 6]
    pool.scrub(slot)
    pool.close_shares(slot)
    pool.scrubbed(slot, CleanResult(ok=True))
    assert slot.state == FREE and not slot.share_closed


async def test_an_unused_share_grant_leaves_the_gpu_to_its_scrub_when_nothing_is_left() -> None:
    pool, _ = pool_of(1)
    slot = pool.slots[0]
    slot.state = FREE
    a, b = waiter(1), waiter(2)
    pool.grant_share(slot, a)
    pool.grant_share(slot, b)
    assert pool.release_share(slot, a) is False
    assert pool.release_share(slot, b) is True and slot.ended_at is not None
