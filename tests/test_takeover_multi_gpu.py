"""Restart take-over of a lease of several GPUs (issue 37, item 2): the new gpupoold reserves every
GPU of a previous daemon's lease of several GPUs (none scrubbed, none pre-started, none granted to
another), adopts its one worker, holds all its slots in one step, and scrubs them all when it ends
(one failing quarantined alone); a lease it cannot take over ends, and its GPUs are scrubbed. The
lease manager with the fakes of tests/test_leases.py; the end-to-end check is
tests/test_e2e_restart_multi_gpu.py."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from test_leases import (
    FakeCleaner,
    FakeStore,
    FakeSupervisor,
    FakeWorker,
    client,
    lease_on,
    make_gpu,
    mgr,  # noqa: F401
    settle,
    wait_for_state,
)

from gpupoold.config.settings import Settings
from gpupoold.gpu.inventory import Gpu, Inventory
from gpupoold.pool.counters import Counters
from gpupoold.pool.leases import LeaseManager
from gpupoold.pool.requirements import Requirements
from gpupoold.pool.slots import FREE, LEASED, QUARANTINED, SCRUBBING
from gpupoold.store.records import LeaseRecord
from gpupoold.workers.supervisor import AdoptError

LEASE = 7


@pytest.fixture(autouse=True)
def fake_workers_are_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The take-over tells an adopted worker from an AdoptError by its class: the fakes are
    workers here."""
    for module in ("gpupoold.pool.leases", "gpupoold.pool.takeover"):
        monkeypatch.setattr(f"{module}.Worker", FakeWorker)


class PreviousWorkers(FakeSupervisor):
    """The previous daemon's worker of lease 7, listening on its adoption socket (None: gone).
    It answers its adoption once `answer` is set, as the session of `session` on the GPU of
    `uuid` (its lease's first GPU: the worker's own), attached unless `detached_bytes`."""

    def __init__(self, uuid: str | None, session: int = LEASE,
                 detached_bytes: int | None = None) -> None:
        super().__init__()
        self.uuid, self.session, self.detached_bytes = uuid, session, detached_bytes
        self.answer = asyncio.Event()
        self.answer.set()
        self.adopted_on: list[int] = []
        self.kept: set[int] | None = None  # the pids kill_orphans spared
        self.retired: list[FakeWorker] = []

    async def connect_adoption(self, path: Path) -> tuple[Any, int]:  # type: ignore[override]
        if self.uuid is None:
            raise AdoptError(f"no worker listens on {path}")
        return object(), 4242

    def kill_orphans(self, keep: set[int]) -> None:
        self.kept = set(keep)

    async def adopt(self, gpu: Gpu, sock: Any, pid: int, max_wait: float = 0.0) -> FakeWorker:
        self.adopted_on.append(gpu.index)
        await self.answer.wait()
        w = FakeWorker(gpu)
        w.pid, w.session_id, w.adoptable = pid, self.session, True
        w.uuid, w.request, w.orphaned_s = self.uuid, {"gpu": "", "model": ""}, 1.5  # type: ignore[attr-defined]
        w.adopted_detached = self.detached_bytes  # type: ignore[attr-defined]
        self.spawned.append(w)
        return w

    async def retire(self, worker: FakeWorker) -> None:
        self.retired.append(worker)
        worker.finish("server ended")


def record(gpus: tuple[int, ...], first: Gpu) -> LeaseRecord:
    return LeaseRecord(gpu_index=gpus[0], gpu_uuid=first.uuid, gpu_name=first.name,
                       simulated=True, token_name="alice", client_host="h", client_user="u",
                       client_pid=9, program="p", peer="10.0.0.9:1", request="2 GPUs",
                       queued_s=0.0, started=1.0, id=LEASE, ended=None, end_reason=None,
                       end_detail=None, bytes_h2d=0, bytes_d2h=0, calls={}, scrub_ok=None,
                       scrub=None, gpus=gpus)


async def restarted(tmp_path: Path, supervisor: PreviousWorkers, gpus: tuple[int, ...] = (2, 0),
                    n_gpus: int = 3, events: dict[int, Any] | None = None) -> LeaseManager:
    """A gpupoold of `n_gpus` GPUs starting where the previous one left lease 7 open on `gpus`."""
    inventory = [make_gpu(i) for i in range(n_gpus)]
    first = inventory[gpus[0]] if gpus[0] < n_gpus else make_gpu(gpus[0])
    store = FakeStore(open=[record(gpus, first)], events=events or {})
    m = LeaseManager(Inventory(tuple(inventory)), Settings(state_dir=tmp_path), store,  # type: ignore[arg-type]
                     supervisor, FakeCleaner(), Counters())  # type: ignore[arg-type]
    await m.start()
    return m


async def until(what: str, check: Any, timeout: float = 3.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        await asyncio.sleep(0.01)


async def test_every_gpu_of_the_lease_is_kept_adopted_in_one_step_then_scrubbed(
        tmp_path: Path) -> None:
    supervisor = PreviousWorkers(make_gpu(2).uuid)
    m = await restarted(tmp_path, supervisor)  # lease 7 on GPUs 2 and 0, program order
    try:
        await until("lease 7 taken over", lambda: m.pool.lease(LEASE) is not None)
        await wait_for_state(m, 1, FREE)
        lease = m.pool.lease(LEASE)
        assert lease is not None and lease.slot is m.slots[2]
        assert lease.other_slots == [m.slots[0]] and lease.gpu_indexes() == [2, 0]
        assert lease.req.gpus == 2  # (an idle detach brings it back on as many)
        assert [s.lease for s in m.slots] == [lease, None, lease]
        assert supervisor.adopted_on == [2] and supervisor.kept == {4242}
        assert m.slots[0].task is m.slots[2].task is lease.watcher  # one watcher moves both on
        # Neither of its GPUs scrubbed nor given a pre-started worker; only GPU 1 was.
        assert m.cleaner.cleaned == [1]
        assert [w.gpu.index for w in supervisor.spawned if w is not lease.worker] == [1]
        assert m.store.ended == {}
        # Nobody else gets them: a 1-GPU client takes GPU 1, the next one waits.
        w1 = m.enqueue(Requirements(), "bob", client(1))
        assert (await asyncio.wait_for(w1.future, 1)) is m.slots[1]
        w2 = m.enqueue(Requirements(), "bob", client(2))
        await settle()
        assert not w2.future.done()
        # Its client leaves: both GPUs scrubbed (the record gets the result), and the waiter
        # gets one of them only after its scrub.
        lease.worker.finish("client exit")
        granted = await asyncio.wait_for(w2.future, 3)
        assert granted in (m.slots[0], m.slots[2])
        await until("both scrubbed", lambda: sorted(m.cleaner.cleaned) == [0, 1, 2])
        assert m.store.ended[LEASE][0] == "client exit" and m.store.scrubbed[LEASE][0] is True
        await wait_for_state(m, 2 if granted is m.slots[0] else 0, FREE)
    finally:
        await m.close(0.1)


async def test_a_failing_scrub_after_the_adopted_lease_quarantines_that_gpu_alone(
        tmp_path: Path) -> None:
    m = await restarted(tmp_path, PreviousWorkers(make_gpu(2).uuid))
    try:
        await until("lease 7 taken over", lambda: m.pool.lease(LEASE) is not None)
        await wait_for_state(m, 1, FREE)
        lease = m.pool.lease(LEASE)
        assert lease is not None
        m.cleaner.results = [False]  # the first of its two scrubs fails
        lease.worker.finish("client exit")
        await until("its GPUs scrubbed", lambda: all(s.state in (FREE, QUARANTINED)
                                                     for s in m.slots))
        assert sorted(s.state for s in (m.slots[0], m.slots[2])) == [FREE, QUARANTINED]
        assert m.store.scrubbed[LEASE][0] is False  # the record keeps the failure
    finally:
        await m.close(0.1)


async def test_its_gpus_stay_reserved_while_its_busy_worker_has_not_answered(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("gpupoold.pool.leases.ADOPT_PEEK", 0.05)
    supervisor = PreviousWorkers(make_gpu(2).uuid)
    supervisor.answer.clear()  # busy in a long call
    m = await restarted(tmp_path, supervisor)
    try:
        await wait_for_state(m, 1, FREE)
        for i in (0, 2):
            assert m.slots[i].state == LEASED and m.slots[i].adopting == LEASE, m.slots[i]
        w = m.enqueue(Requirements(gpus=2), "bob", client(1))
        await asyncio.sleep(0.1)
        assert not w.future.done() and m.cleaner.cleaned == [1]
        supervisor.answer.set()
        await until("lease 7 taken over", lambda: m.pool.lease(LEASE) is not None)
        assert [s.adopting for s in m.slots] == [None, None, None]
        assert not w.future.done()
    finally:
        await m.close(0.1)


@pytest.mark.parametrize("why", ["gone", "another session", "another gpu"])
async def test_a_lease_not_taken_over_ends_and_every_gpu_is_scrubbed(
        tmp_path: Path, why: str) -> None:
    """Its worker gone, serving another session, or on another GPU than the record's first: the
    record is closed, the worker ended, and all the lease's GPUs scrubbed before anyone gets
    them."""
    supervisor = {"gone": PreviousWorkers(None),
                  "another session": PreviousWorkers(make_gpu(2).uuid, session=99),
                  "another gpu": PreviousWorkers(make_gpu(1).uuid)}[why]
    m = await restarted(tmp_path, supervisor)
    try:
        await until("its record closed and scrubbed", lambda: LEASE in m.store.scrubbed)
        await until("every GPU free", lambda: all(s.state == FREE for s in m.slots))
        assert sorted(m.cleaner.cleaned) == [0, 1, 2]
        assert m.pool.lease(LEASE) is None and m.store.ended[LEASE][0] == "daemon lost"
        detail = m.store.ended[LEASE][1]
        assert ("worker is gone" if why == "gone" else "could not take over") in detail, detail
        if why != "gone":
            assert all(w.exited.done() for w in supervisor.spawned if w.session_id == (
                99 if why == "another session" else LEASE))
    finally:
        await m.close(0.1)


async def test_a_detached_lease_of_two_gpus_is_taken_over_and_comes_back_on_two(
        tmp_path: Path) -> None:
    """Detached when the previous daemon stopped (its worker parked, saying so): taken over on
    no GPU with both GPUs it left as its homes (program order), every GPU scrubbed and served
    meanwhile, its place counted for both; its client's call brings it back on two GPUs."""
    from test_detach import FakeCheckpointer

    from gpupoold.pool.slots import ATTACHED, DETACHED

    events = {LEASE: [("detached", 2, "idle", 1)]}
    supervisor = PreviousWorkers(make_gpu(2).uuid, detached_bytes=1 << 20)
    m = await restarted(tmp_path, supervisor, events=events)
    try:
        await until("taken over detached", lambda: m.pool.lease(LEASE) is not None)
        lease = m.pool.lease(LEASE)
        assert lease is not None and lease.state == DETACHED and lease.slot is None
        assert lease.homes == [m.slots[2].gpu, m.slots[0].gpu] and lease.req.gpus == 2
        await until("every GPU free", lambda: all(s.state == FREE for s in m.slots))
        assert m.pool.held("alice") == 2 and LEASE not in m.store.ended
        m.detacher.checkpointer = FakeCheckpointer()  # type: ignore[assignment]
        lease.worker.wants_gpu.set()
        await until("attached", lambda: lease.state == ATTACHED)
        # The queue grants the first two free GPUs (0 and 1); GPU 0 stays its device 1, GPU 1
        # is its device 0 now, and the restore pairs every GPU it left with its new one.
        assert lease.gpu_indexes() == [1, 0] and lease.req.gpus == 2
        uuid = [s.gpu.uuid for s in m.slots]
        assert m.detacher.checkpointer.calls[-1] == (  # type: ignore[attr-defined]
            "attach", 1, lease.worker.pid, ((uuid[2], uuid[1]), (uuid[0], uuid[0])))
    finally:
        await m.close(0.1)


async def test_a_lease_that_moved_is_taken_over_on_the_gpus_of_its_last_attach(
        tmp_path: Path) -> None:
    """Detached from GPUs 2 and 0, back on 1 and 2 (schema v15: every GPU of each event): the
    new gpupoold finds it there, adopts its worker on GPU 1 (its device 0 now) and keeps both;
    GPU 0, which it left, is scrubbed and served."""
    events = {LEASE: [("detached", 2, "idle", 1, [2, 0]),
                      ("attached", 1, "moved from GPU 2, 0", 1, [1, 2])]}
    supervisor = PreviousWorkers(make_gpu(1).uuid)
    m = await restarted(tmp_path, supervisor, events=events)
    try:
        await until("lease 7 taken over", lambda: m.pool.lease(LEASE) is not None)
        await wait_for_state(m, 0, FREE)
        lease = m.pool.lease(LEASE)
        assert lease is not None and lease.gpu_indexes() == [1, 2] and lease.req.gpus == 2
        assert [s.lease for s in m.slots] == [None, lease, lease]
        assert supervisor.adopted_on == [1] and supervisor.kept == {4242}
        assert m.cleaner.cleaned == [0] and m.store.ended == {}
    finally:
        await m.close(0.1)


async def test_a_lease_detached_again_after_it_moved_keeps_the_gpus_it_left_last(
        tmp_path: Path) -> None:
    """Back on GPUs 1 and 2 after a detach, then detached again: taken over detached with those
    two as the GPUs it left (program order), not the ones it started on."""
    from gpupoold.pool.slots import DETACHED

    events = {LEASE: [("detached", 2, "idle", 1, [2, 0]),
                      ("attached", 1, "moved from GPU 2, 0", 1, [1, 2]),
                      ("detached", 1, "idle", 2, [1, 2])]}
    supervisor = PreviousWorkers(make_gpu(1).uuid, detached_bytes=1 << 20)
    m = await restarted(tmp_path, supervisor, events=events)
    try:
        await until("taken over detached", lambda: m.pool.lease(LEASE) is not None)
        lease = m.pool.lease(LEASE)
        assert lease is not None and lease.state == DETACHED
        assert lease.homes == [m.slots[1].gpu, m.slots[2].gpu] and lease.req.gpus == 2
    finally:
        await m.close(0.1)


async def test_a_lease_that_moved_before_v15_or_lost_a_gpu_is_not_taken_over(
        tmp_path: Path) -> None:
    """Events written before schema v15 name the first GPU a lease came back on only: one of
    several GPUs that moved then is ended (its worker killed as an orphan); so is one whose GPU
    this server no longer has."""
    moved = {LEASE: [("detached", 2, "idle", 1), ("attached", 1, "moved from GPU 2, 0", 1)]}
    for events, gpus, n_gpus, says in ((moved, (2, 0), 3, "moved to other GPUs"),
                                       ({}, (0, 3), 3, "GPU 3 of it is not served")):
        supervisor = PreviousWorkers(make_gpu(gpus[0]).uuid)
        m = await restarted(tmp_path, supervisor, gpus, n_gpus, events)
        try:
            await until("every GPU free", lambda m=m: all(s.state == FREE for s in m.slots))
            assert supervisor.adopted_on == [] and supervisor.kept == set()  # killed
            assert m.store.ended[LEASE][0] == "daemon lost" and says in m.store.ended[LEASE][1]
            assert m.store.scrubbed[LEASE][0] is True and sorted(m.cleaner.cleaned) == [0, 1, 2]
        finally:
            await m.close(0.1)


async def test_close_keeps_an_adoptable_lease_of_several_gpus_and_its_gpus(mgr: Any) -> None:  # noqa: F811
    """A clean stop leaves the lease of several GPUs running for the next daemon, with every
    one of its GPUs (a simulated GPU's memory file stays for each: app.py's kept_gpus)."""
    m = await mgr(n_gpus=3)
    _, lease = await lease_on(m, 1, req=Requirements(gpus=2))
    lease.worker.adoptable = True
    await m.close(0.1)
    assert lease.worker.detached and not lease.worker.exited.done()
    assert lease.id not in m.store.ended and m.kept_gpus == frozenset({0, 1})
    assert [s.state for s in m.slots] == [LEASED, LEASED, FREE]
    assert SCRUBBING not in {s.state for s in m.slots}


async def test_close_keeps_a_lease_of_several_gpus_detached_or_back_from_a_detach(
        mgr: Any) -> None:  # noqa: F811
    """Detached from two GPUs: kept (the next daemon takes it over detached). Back on two GPUs
    after a detach: kept too, on both (its events name every GPU it came back on, schema v15,
    so the next daemon finds them: pool/takeover.py, _gpus_of)."""
    for detached in (True, False):
        m = await mgr(n_gpus=2)
        _, lease = await lease_on(m, 1, req=Requirements(gpus=2))
        lease.worker.adoptable = True
        lease.homes = [s.gpu for s in lease.slots()]  # (as pool/state.py's detach leaves them)
        if detached:
            m.pool.park(lease, 1 << 20)
            m.pool.detach(lease, 0.1)
        await m.close(0.1)
        assert lease.worker.detached is True and lease.worker.exited.done() is False
        assert lease.id not in m.store.ended
        assert m.kept_gpus == (frozenset() if detached else frozenset({0, 1}))


def test_adopted_takes_every_gpu_of_the_lease_or_none() -> None:
    """pool/state.py's adopted of a lease of several GPUs: each GPU must be being taken over for
    that lease; a refused edge on one changes nothing."""
    from gpupoold.pool.events import EventBus
    from gpupoold.pool.slots import Lease
    from gpupoold.pool.state import PoolState, TransitionError

    pool = PoolState([make_gpu(i) for i in range(3)], EventBus())
    pool.adopt(pool.slots[0], LEASE)
    pool.adopt(pool.slots[2], LEASE)
    lease = Lease(id=LEASE, slot=None, token="t", client=client(1), req=Requirements(gpus=2),
                  worker=None, queued_s=0.0)  # type: ignore[arg-type]
    with pytest.raises(TransitionError):  # GPU 1 is not being taken over (still scrubbing)
        pool.adopted(pool.slots[0], lease, [pool.slots[1]])
    assert pool.active() == [] and pool.slots[0].adopting == LEASE and pool.slots[0].lease is None
    pool.adopted(pool.slots[2], lease, [pool.slots[0]])
    assert [s.lease for s in pool.slots] == [lease, None, lease] and pool.active() == [lease]
    assert lease.gpu_indexes() == [2, 0] and [s.adopting for s in pool.slots] == [None] * 3
