"""A lease of several GPUs on one server (issue 37): requirements, the all-or-nothing grant and its
head-of-line policy, the lease's GPUs from start to scrub (the lease manager with the fakes of
tests/test_leases.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import gpupool_protocol as gp
import pytest
from test_leases import GIB, client, lease_on, make_gpu, mgr, settle  # noqa: F401

from gpupoold.gpu.cleaner import CleanResult
from gpupoold.pool.events import EventBus
from gpupoold.pool.leases import LeaseManager
from gpupoold.pool.requirements import Requirements
from gpupoold.pool.slots import FREE, LEASED, QUARANTINED, Lease
from gpupoold.pool.state import PoolState, TransitionError
from gpupoold.pool.waitqueue import Waiter

FOUR = Requirements(gpus=4)


def hello(**fields: Any) -> gp.Hello:
    return gp.Hello(magic=gp.MAGIC, major=gp.MAJOR, minor=gp.MINOR, **fields)


def test_requirements_from_the_hello() -> None:
    assert Requirements.from_hello(hello()).gpus == 1  # a 1.5 client's hello reads gpus = 0
    req = Requirements.from_hello(hello(gpus=4, memory=10 * GIB))
    assert (req.gpus, req.memory) == (4, 10 * GIB)
    assert req.describe() == "4 GPUs, 10 GiB of memory"
    assert req.quota(make_gpu(0, memory=80 * GIB)) == 10 * GIB
    assert Requirements(memory=100 * GIB).quota(make_gpu(0, memory=80 * GIB)) == 80 * GIB
    assert Requirements().quota(make_gpu(0)) == 0
    gpus = [make_gpu(0), make_gpu(1), make_gpu(2, name="Tesla T4")]
    assert Requirements(gpus=2, model="H100").too_many(gpus) is None
    why = Requirements(gpus=3, model="H100").too_many(gpus)
    assert why is not None and "GPUPOOL_GPUS asked for 3" in why and "has 2 GPUs that meet" in why


async def grant(m: LeaseManager, n: int, req: Requirements, token: str = "alice") -> Waiter:
    return m.enqueue(req, token, client(n))


async def test_four_gpus_granted_at_once_to_one_worker_told_their_ordinals(mgr: Any) -> None:  # noqa: F811
    m = await mgr(n_gpus=4)
    idle = [s.idle_worker for s in m.slots]
    assert all(w is not None for w in idle)
    w = await grant(m, 1, Requirements(gpus=4, memory=200 * GIB))
    first = await asyncio.wait_for(w.future, 1)
    assert [s.gpu.index for s in w.granted] == [0, 1, 2, 3]
    assert all(s.state == LEASED and s.reserved is w for s in m.slots)
    lease = await m.begin(w, first, b"hello", 1, -1)
    assert lease.worker is idle[0]
    # (simulated GPUs: ordinal 0 of GPU 0's config, then its peers GPU 1, 2, 3 at 1, 2, 3)
    assert lease.worker.devices == [0, 1, 2, 3] and lease.worker.memory_quota == 80 * GIB
    assert lease.gpu_indexes() == [0, 1, 2, 3] and m.store.gpus[lease.id] == [0, 1, 2, 3]
    assert all(s.lease is lease for s in m.slots)
    # The other GPUs' idle workers ended (they hold a context there); the lease keeps its GPUs
    assert all(w.exited.done() for w in idle[1:])
    assert lease.keep_gpu is None  # it may detach, from all four at once (pool/detach.py)
    # its end: every GPU scrubbed, free again, each with a pre-started worker again
    lease.worker.finish("client lost", "SIGKILL")
    for _ in range(100):
        await settle()
        if all(s.state == FREE and s.idle_worker is not None for s in m.slots):
            break
    assert [s.state for s in m.slots] == [FREE] * 4
    assert sorted(m.cleaner.cleaned[-4:]) == [0, 1, 2, 3]
    assert m.store.ended[lease.id][0] == "client lost" and m.store.scrubbed[lease.id][0]
    assert all(s.idle_worker is not None and not s.idle_worker.exited.done() for s in m.slots)


async def test_a_one_gpu_lease_sends_no_device_list(mgr: Any) -> None:  # noqa: F811
    m = await mgr(n_gpus=2)
    _, lease = await lease_on(m, 1)
    assert lease.worker.devices == [] and lease.worker.memory_quota == 0
    assert lease.gpu_indexes() == [lease.slot.gpu.index]


async def test_a_big_request_waits_for_all_and_keeps_its_turn(mgr: Any) -> None:  # noqa: F811
    """Head of line: a 4-GPU waiter takes none while fewer are free; the GPUs freed meanwhile
    are not given to the 1-GPU client behind it, which is served after it, in order."""
    m = await mgr(n_gpus=4)
    _, first = await lease_on(m, 1, req=FOUR)
    second = await grant(m, 2, FOUR)
    small = await grant(m, 3, Requirements())  # the same token: served in arrival order
    await settle()
    assert not second.future.done() and not small.future.done()
    assert m.queue.position(second) == 1 and m.queue.position(small) == 2
    first.worker.finish("client exit")
    for _ in range(100):
        await settle()
        if second.future.done():
            break
    assert second.future.done() and [s.gpu.index for s in second.granted] == [0, 1, 2, 3]
    assert not small.future.done()  # all 4 went to the 4-GPU client ahead of it
    big = await m.begin(second, second.future.result(), b"hello", 2, -1)
    big.worker.finish("client exit")
    slot = await asyncio.wait_for(small.future, 2)
    assert slot.state == LEASED and slot.reserved is small


async def test_freed_gpus_are_held_back_for_the_big_request_ahead(mgr: Any) -> None:  # noqa: F811
    m = await mgr(n_gpus=4)
    _, a = await lease_on(m, 1)
    _, b = await lease_on(m, 2)
    big = await grant(m, 3, FOUR)
    small = await grant(m, 4, Requirements())
    await settle()
    assert [s.state for s in m.slots].count(FREE) == 2  # free, yet held back for `big`
    assert not big.future.done() and not small.future.done()
    assert not any(s.reserved is big for s in m.slots)  # it holds nothing while it waits
    a.worker.finish("client exit")
    for _ in range(50):
        await settle()
    assert not big.future.done() and not small.future.done()
    b.worker.finish("client exit")
    await asyncio.wait_for(big.future, 2)
    assert len(big.granted) == 4 and not small.future.done()


async def test_more_gpus_than_the_server_has_are_refused_at_once(mgr: Any) -> None:  # noqa: F811
    m = await mgr(n_gpus=2, max_gpus_per_token=0)
    why = m.feasible(FOUR)
    assert why is not None and "GPUPOOL_GPUS asked for 4" in why and "has 2 GPUs" in why
    assert m.feasible(Requirements(gpus=2)) is None
    m2 = await mgr(n_gpus=4, max_gpus_per_token=2)
    why = m2.feasible(FOUR)
    assert why is not None and "max_gpus_per_token" in why


async def test_a_failed_scrub_quarantines_that_gpu_alone(mgr: Any) -> None:  # noqa: F811
    m = await mgr(n_gpus=3)
    m.cleaner.results = [True, False, True]
    _, lease = await lease_on(m, 1, req=Requirements(gpus=3))
    lease.worker.finish("client exit")
    for _ in range(100):
        await settle()
        if all(s.state in (FREE, QUARANTINED) for s in m.slots):
            break
    states = [s.state for s in m.slots]
    assert states.count(QUARANTINED) == 1 and states.count(FREE) == 2
    assert m.store.scrubbed[lease.id][0] is False  # the record keeps the failure


def test_start_is_all_or_none() -> None:
    pool = PoolState([make_gpu(i) for i in range(3)], EventBus())
    for s in pool.slots:
        pool.scrubbed(s, CleanResult(ok=True))
    w: Any = object()
    pool.grant(pool.slots[0], w)
    pool.grant(pool.slots[1], w)
    lease = Lease(id=7, slot=None, token="t", client=client(1), req=FOUR, worker=None,  # type: ignore[arg-type]
                  queued_s=0.0)
    with pytest.raises(TransitionError):  # GPU 2 was not granted: nothing changes
        pool.start(pool.slots[0], lease, [pool.slots[1], pool.slots[2]])
    assert all(s.lease is None for s in pool.slots) and pool.active() == []
    pool.start(pool.slots[0], lease, [pool.slots[1]])
    assert [s.lease for s in pool.slots] == [lease, lease, None]
    pool.end(lease, "client exit", lease_stats())
    assert all(s.lease is None for s in pool.slots)
    assert [s.state for s in pool.slots] == [LEASED, LEASED, FREE]  # until their scrubs


def lease_stats() -> Any:
    from gpupoold.workers.supervisor import WorkerStats
    return WorkerStats()


async def test_the_record_lists_the_gpus_and_a_restart_without_its_worker_scrubs_them(
        tmp_path: Any) -> None:
    """The store keeps every GPU of the lease (schema v12); a previous daemon's lease of several
    GPUs whose worker is gone is closed at start-up, every GPU scrubbed (the take-over of one
    whose worker lives: tests/test_takeover_multi_gpu.py)."""
    from dataclasses import replace

    from test_leases import FakeCleaner, FakeStore, FakeSupervisor

    from gpupoold.config.settings import Settings
    from gpupoold.gpu.inventory import Inventory
    from gpupoold.pool.counters import Counters
    from gpupoold.store.database import StoreDB
    from gpupoold.store.records import NewLease

    db = StoreDB(tmp_path / "gpupoold.db")
    try:
        lease_id = db.lease_started(NewLease(
            gpu_index=1, gpu_uuid="", gpu_name="sim", simulated=True, token_name="t",
            client_host="h", client_user="u", client_pid=1, program="p", peer="x",
            request="2 GPUs", queued_s=0.0, started=1.0))
        db.lease_gpus(lease_id, [1, 0])
        record = db.get_lease(lease_id)
        assert record is not None and record.gpus == (1, 0)
        assert record.to_json()["gpus"] == [1, 0]
        one = db.lease_started(replace(db.get_lease(lease_id), gpu_index=0))  # type: ignore[arg-type]
        assert db.get_lease(one).to_json()["gpus"] == [0]  # type: ignore[union-attr]
    finally:
        db.close()
    open_rec = replace(record, id=9)
    store = FakeStore(open=[open_rec])
    m = LeaseManager(Inventory((make_gpu(0), make_gpu(1))), Settings(state_dir=tmp_path), store,  # type: ignore[arg-type]
                     FakeSupervisor(), FakeCleaner(), Counters())  # type: ignore[arg-type]
    await m.start()
    await settle()
    try:
        assert store.ended[9][0] == "daemon lost" and "worker is gone" in store.ended[9][1]
        assert store.scrubbed[9][0] is True
        assert sorted(m.cleaner.cleaned) == [0, 1]
    finally:
        await m.close(0.1)


def test_device_ordinals_as_the_first_gpus_worker_sees_them() -> None:
    from dataclasses import replace

    from gpupoold.workers.supervisor import device_ordinal

    sims = [make_gpu(i) for i in range(4)]  # each ordinal 0 of its own config
    assert [device_ordinal(sims[2], g) for g in (sims[2], sims[0], sims[1], sims[3])] == [0, 1, 2, 3]
    assert [device_ordinal(sims[0], g) for g in sims] == [0, 1, 2, 3]
    real = [replace(g, simulated=False, ordinal=5 + g.index) for g in sims]
    assert [device_ordinal(real[1], g) for g in (real[1], real[3])] == [6, 8]


async def test_the_utilisation_accounting_counts_the_lease_on_each_gpu(mgr: Any) -> None:  # noqa: F811
    from gpupoold.pool.usage_recorder import UsageRecorder

    class Live:
        def live(self, index: int) -> dict[str, Any]:
            return {"gpu_util": 50}

    class Usage:
        async def record_usage(self, delta: Any, before: float) -> None:
            pass

    m = await mgr(n_gpus=3)
    now = [1000.0]
    rec = UsageRecorder(Usage(), m, Live(), 1.0, 90, clock=lambda: now[0],  # type: ignore[arg-type]
                        flush_s=1e9)
    off = rec.subscribe(m.events)
    try:
        _, lease = await lease_on(m, 1, req=Requirements(gpus=2))
        rec.observe_all()
        now[0] += 10
        rec.observe_all()
        now[0] += 5
        lease.worker.finish("client exit")
        for _ in range(20):
            await settle()
        totals = {g: round(t.leased_s, 3) for g, t in rec.meter.gpus.items()}
        assert totals == {0: 15.0, 1: 15.0, 2: 0.0}  # both its GPUs, to its end; GPU 2 free
        assert round(rec.meter.gpus[1].busy_s, 3) == 7.5  # by utilisation
    finally:
        off()


def test_a_fleet_serves_several_gpus_of_one_server_and_refuses_more_than_any_has(
        tmp_path: Any) -> None:
    """In a fleet a lease of several GPUs comes from one server (pool/fleet.py's match): this
    server's 4 serve 2; 5 fit on no live server (the others' counts come from the last sync:
    none yet), and the refusal says the counts, for a client it could redirect or not."""
    from test_leases import FakeCleaner, FakeStore, FakeSupervisor

    from gpupoold.config.settings import Settings
    from gpupoold.gpu.inventory import Inventory
    from gpupoold.pool.counters import Counters

    store = FakeStore()
    store.server = "a"  # type: ignore[attr-defined]  # (a server's name in the fleet)
    m = LeaseManager(Inventory(tuple(make_gpu(i) for i in range(4))), Settings(state_dir=tmp_path),
                     store, FakeSupervisor(), FakeCleaner(), Counters(),  # type: ignore[arg-type]
                     shared_store=True)
    for redirectable in (False, True):
        assert m.feasible(Requirements(gpus=2), redirectable) is None
        why = m.feasible(Requirements(gpus=5), redirectable)
        assert why is not None and "GPUPOOL_GPUS asked for 5" in why and "has 4" in why
    assert m.feasible(Requirements(), True) is None


def test_the_gpu_seconds_metric_counts_each_gpu_of_an_ended_lease() -> None:
    from gpupoold.http.metrics import DaemonMetrics
    from gpupoold.pool.events import LeaseEnded
    from gpupoold.workers.supervisor import WorkerStats

    metrics = DaemonMetrics()
    metrics.lease_ended(LeaseEnded(1, 0, "alice", "client exit", 10.0, WorkerStats(), (0, 1, 2)))
    metrics.lease_ended(LeaseEnded(2, 3, "alice", "client exit", 5.0, WorkerStats()))
    assert metrics.ended.gpu_seconds == {"alice": 35.0}


async def test_a_big_request_that_cannot_be_served_now_holds_nothing_back(mgr: Any) -> None:  # noqa: F811
    m = await mgr(n_gpus=3)
    _, a = await lease_on(m, 1)
    big = await grant(m, 2, Requirements(gpus=3))
    small = await grant(m, 3, Requirements())
    await settle()
    assert not small.future.done()  # the 2 free GPUs are kept for the 3-GPU request
    await m.drain(2, "admin")  # (free: drained at once) now only 2 of its 3 are in service
    await settle()
    slot = await asyncio.wait_for(small.future, 1)
    assert slot.gpu.index in (0, 1) and not big.future.done()
    assert a.slot.state == LEASED


def test_gpupool_status_lists_every_gpu_of_my_lease() -> None:
    from gpupool.status import _lease_where

    gpus = [{"index": i, "lease": {"id": 7 if i < 3 else 8}} for i in range(4)]
    assert _lease_where({"id": 7, "gpu": 0}, gpus) == "on GPUs 0, 1, 2"
    assert _lease_where({"id": 8, "gpu": 3}, gpus) == "on GPU 3"
    assert _lease_where({"id": 9, "gpu": None}, gpus).startswith("detached while idle")
