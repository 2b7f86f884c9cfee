"""The lease manager (gpupoold/pool/leases.py) with fake workers, store and cleaner: grants, the FIFO
queue, token limits, lease ends, scrub outcomes, drain/undrain, quarantine/clear, max duration."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import gpupool_protocol as gp
import pytest

from gpupoold.config.settings import Settings
from gpupoold.gpu.cleaner import CleanResult
from gpupoold.gpu.inventory import Gpu, Inventory
from gpupoold.pool.counters import Counters
from gpupoold.pool.leases import (
    LeaseError,
    LeaseManager,
    LeaseStartError,
    QueueFull,
    Slot,
)
from gpupoold.pool.requirements import Requirements
from gpupoold.pool.slots import DRAINED, FREE, LEASED, QUARANTINED, SCRUBBING
from gpupoold.pool.views import PoolViews
from gpupoold.pool.waitqueue import ClientInfo, Waiter
from gpupoold.store.records import LeaseRecord
from gpupoold.workers.supervisor import AdoptError, WorkerExit, WorkerStats

GIB = 1 << 30
_pids = itertools.count(1000)


def make_gpu(i: int, name: str = "NVIDIA H100 80GB HBM3 (gpupool simulated)",
             memory: int = 80 * GIB) -> Gpu:
    return Gpu(index=i, name=name, uuid=f"GPU-{i:08x}-0000-0000-0000-000000000000",
               simulated=True, driver="sim.so", ordinal=0, memory_total=memory)


class FakeWorker:
    def __init__(self, gpu: Gpu) -> None:
        self.pid = next(_pids)
        self.gpu = gpu
        self.init_ms = 1.0
        self.session_id: int | None = None
        self.stats = WorkerStats(calls={"launch": 0, "copy": 0, "alloc": 0, "sync": 0,
                                        "other": 0})
        self.exited: asyncio.Future[WorkerExit] = asyncio.get_running_loop().create_future()
        self.ended_with: tuple[str, int] | None = None
        self.start_ok = True
        self.adoptable = False  # its session may outlive the daemon (the real one says so)
        self.reported_end = False
        self.detached = False
        # Idle detach (tests/test_detach.py): what it answers when asked (None: "no, busy"),
        # and what it was told.
        self.active_at = float("-inf")
        self.wants_gpu = asyncio.Event()
        self.idle_answer: Any = gp.WorkerDetachOk(session_id=0, idle_ms=1000, mem_used=GIB)
        self.asked = 0
        self.told: list[tuple[str, ...]] = []

    def detach(self) -> None:
        self.detached = True

    async def ask_detach(self, idle_ms: int) -> Any:
        self.asked += 1
        if self.exited.done():
            return None
        return self.idle_answer

    async def tell_detached(self) -> None:
        self.told.append(("detached",))

    async def tell_attached(self, gpu: Gpu, moved: bool) -> None:
        self.gpu = gpu
        self.told.append(("attached", gpu.uuid, str(moved)))

    async def assign(self, session_id: int, client_fd: int, hello_body: bytes,
                     hello_req: int, devices: Any = (), memory_quota: int = 0) -> None:
        self.session_id = session_id
        self.devices, self.memory_quota = list(devices), memory_quota  # (issue 37)

    async def wait_started(self, timeout: float) -> bool:
        return self.start_ok

    async def end(self, text: str, code: int) -> None:
        self.ended_with = (text, code)
        self.finish("server ended")

    def kill(self) -> None:
        self.finish("worker crashed", "killed by SIGKILL")

    def finish(self, reason: str, detail: str = "", bytes_h2d: int = 0) -> None:
        if not self.exited.done():
            self.stats.bytes_h2d = bytes_h2d
            self.exited.set_result(WorkerExit(reason, detail, 0, self.stats))


class FakeSupervisor:
    worker = Path("/fake/gpupool-worker")

    def __init__(self) -> None:
        self.spawned: list[FakeWorker] = []
        self.stopped = False

    async def spawn(self, gpu: Gpu, timeout: float = 60.0) -> FakeWorker:
        w = FakeWorker(gpu)
        self.spawned.append(w)
        return w

    async def stop_all(self, grace: float, keep: frozenset[Any] = frozenset()) -> None:
        self.stopped = True
        for w in self.spawned:
            if w not in keep:
                w.finish("shutdown")

    @staticmethod
    async def connect_adoption(path: Path) -> tuple[Any, int]:
        raise AdoptError(f"no worker listens on {path}")

    # What workers leave under state_dir/workers (pid files, sockets, end records): none here.
    def prepare_workers_dir(self, adoptable: bool) -> None:
        pass

    def adoption_socket(self, lease_id: int) -> Path:
        return Path(f"/nonexistent/lease-{lease_id}.sock")

    def end_record(self, lease_id: int) -> dict[str, Any] | None:
        return None

    def forget_lease(self, lease_id: int) -> None:
        pass

    def kill_orphans(self, keep: set[int]) -> None:
        pass


@dataclass
class FakeStore:
    started: dict[int, Any] = field(default_factory=dict)
    ended: dict[int, tuple[Any, ...]] = field(default_factory=dict)
    scrubbed: dict[int, tuple[bool, dict[str, Any]]] = field(default_factory=dict)
    audits: list[tuple[str, str, str, str]] = field(default_factory=list)
    open: list[Any] = field(default_factory=list)
    events: dict[int, list[tuple[Any, ...]]] = field(default_factory=dict)  # idle detach
    unscrubbed: list[Any] = field(default_factory=list)  # ended, the daemon gone before a scrub
    # Drained/quarantined GPUs, shared by the managers of one test (a restart keeps them).
    gpu_state: dict[str, Any] = field(default_factory=dict)
    tokens: dict[str, Any] = field(default_factory=dict)  # name -> TokenRecord (share weights)

    async def get_token(self, name: str) -> Any:
        return self.tokens.get(name)

    async def lease_started(self, lease: Any, spread: tuple[int, int, int] | None = None) -> int:
        lease_id = len(self.started) + 1
        self.started[lease_id] = lease
        if spread is not None:  # a spread lease's part (issue 37, item 3): (group, part, parts)
            self.spread = {**getattr(self, "spread", {}), lease_id: spread}
        return lease_id

    async def lease_ended(self, lease_id: int, ended: float, reason: str, detail: str,
                          bytes_h2d: int, bytes_d2h: int, calls: dict[str, int],
                          module_bytes: int = 0) -> None:
        self.ended[lease_id] = (reason, detail, bytes_h2d)

    async def lease_gpus(self, lease_id: int, gpus: list[int]) -> None:  # (issue 37)
        self.gpus = {**getattr(self, "gpus", {}), lease_id: gpus}

    async def lease_scrubbed(self, lease_id: int, ok: bool, result: dict[str, Any]) -> None:
        self.scrubbed[lease_id] = (ok, result)

    async def open_leases(self) -> list[Any]:
        return self.open

    async def unscrubbed_last_leases(self) -> list[Any]:
        return self.unscrubbed

    async def lease_event(self, lease_id: int, at: float, state: str, gpu_index: int | None,
                          detail: str, detaches: int, detached_s: float,
                          gpus: Sequence[int] = ()) -> None:
        # (state, gpu, detail, detaches, every GPU it names as the store keeps them: schema v15)
        names = list(gpus) if len(gpus) > 1 else [] if gpu_index is None else [gpu_index]
        self.events.setdefault(lease_id, []).append((state, gpu_index, detail, detaches, names))

    async def lease_events(self, lease_id: int) -> list[dict[str, Any]]:
        """As the store returns them; an event given as 4 values names device 0's GPU only."""
        return [{"at": 0.0, "state": e[0], "gpu": e[1], "detail": e[2],
                 "gpus": e[4] if len(e) > 4 else [] if e[1] is None else [e[1]]}
                for e in self.events.get(lease_id, [])]

    async def audit(self, actor: str, action: str, target: str, detail: str = "") -> None:
        self.audits.append((actor, action, target, detail))

    async def gpu_states(self) -> dict[str, Any]:
        return json.loads(json.dumps(self.gpu_state))

    async def save_gpu_states(self, states: dict[str, Any], gpus: Collection[str]) -> None:
        # As the store does: this server's GPUs' records replaced, other records kept.
        for gpu in set(gpus) | set(states):
            self.gpu_state.pop(gpu, None)
        self.gpu_state.update(json.loads(json.dumps(states)))


class FakeCleaner:
    def __init__(self) -> None:
        self.results: list[bool] = []  # next outcomes; empty: ok
        self.cleaned: list[int] = []
        self.gate: asyncio.Event | None = None  # when set, cleaning waits for it

    async def clean(self, gpu: Gpu) -> CleanResult:
        if self.gate is not None:
            await self.gate.wait()
        self.cleaned.append(gpu.index)
        ok = self.results.pop(0) if self.results else True
        return CleanResult(ok=ok, problems=[] if ok else ["2 volatile uncorrectable ECC errors"],
                           scrub={"ok": True, "bytes": 123})


def client(n: int) -> ClientInfo:
    return ClientInfo(host=f"host{n}", user="u", pid=n, program="prog", peer=f"10.0.0.{n}:1")


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


@pytest.fixture
async def mgr(tmp_path: Path) -> Any:
    managers = []
    gpu_state: dict[str, Any] = {}  # the database's GPU state, as a restart finds it

    async def make(n_gpus: int = 2, gpus: list[Gpu] | None = None, **overrides: Any) -> Any:
        settings = replace(Settings(state_dir=tmp_path), **overrides)
        inv = Inventory(tuple(gpus or [make_gpu(i) for i in range(n_gpus)]))
        m = LeaseManager(inv, settings, FakeStore(gpu_state=gpu_state), FakeSupervisor(),
                         FakeCleaner(), Counters())  # type: ignore[arg-type]
        await m.start()
        await settle()
        managers.append(m)
        return m

    yield make
    for m in managers:
        await m.close(0.1)


async def lease_on(m: LeaseManager, n: int, token: str = "alice",
                   req: Requirements | None = None) -> tuple[Waiter, Any]:
    w = m.enqueue(req or Requirements(), token, client(n))
    slot = await asyncio.wait_for(w.future, 1)
    lease = await m.begin(w, slot, b"hello", 1, -1)
    return w, lease


async def test_startup_scrubs_every_gpu_then_frees_them_with_a_prestarted_worker(mgr: Any) -> None:
    m = await mgr(2)
    assert m.cleaner.cleaned == [0, 1]
    assert [s.state for s in m.slots] == [FREE, FREE]
    assert all(s.idle_worker is not None for s in m.slots)


async def test_a_lease_uses_the_prestarted_worker_and_is_recorded(mgr: Any) -> None:
    m = await mgr(1)
    idle = m.slots[0].idle_worker
    _, lease = await lease_on(m, 1)
    assert lease.worker is idle and idle.session_id == lease.id
    assert m.slots[0].state == LEASED
    rec = m.store.started[lease.id]
    assert (rec.gpu_index, rec.token_name, rec.client_host) == (0, "alice", "host1")
    lease.worker.finish("client exit", bytes_h2d=4096)
    await settle()
    assert m.store.ended[lease.id] == ("client exit", "", 4096)
    assert m.store.scrubbed[lease.id][0] is True
    assert m.slots[0].state == FREE and m.cleaner.cleaned == [0, 0]
    assert m.slots[0].idle_worker is not None and m.slots[0].idle_worker is not idle


async def test_one_client_per_gpu_and_the_queue_is_served_in_order(mgr: Any) -> None:
    m = await mgr(2)
    leases = [await lease_on(m, i) for i in range(2)]
    waiters = [m.enqueue(Requirements(), "alice", client(10 + i)) for i in range(4)]
    await settle()
    assert not any(w.future.done() for w in waiters)
    assert [m.position(w) for w in waiters] == [(1, 4), (2, 4), (3, 4), (4, 4)]
    order = []
    for _, lease in leases:
        lease.worker.finish("client exit")
    for w in waiters:
        slot = await asyncio.wait_for(w.future, 1)
        order.append(w.client.pid)
        lease = await m.begin(w, slot, b"", 1, -1)
        assert sum(1 for s in m.slots if s.lease is not None) <= 2
        lease.worker.finish("client exit")
    assert order == [10, 11, 12, 13]


async def test_a_lease_starts_at_its_grant_not_when_its_worker_is_ready(mgr: Any) -> None:
    """Two waiters granted in turn whose leases begin in the other order (the first one's
    worker was slower to be ready): the history's start times and queue times follow the
    grants, so sorting it by start shows the order the queue served them in."""
    m = await mgr(2)
    leases = [await lease_on(m, i) for i in range(2)]
    first, second = (m.enqueue(Requirements(), "alice", client(10 + i)) for i in range(2))
    await settle()
    leases[0][1].worker.finish("client exit")
    slot1 = await asyncio.wait_for(first.future, 1)
    await asyncio.sleep(0.05)
    leases[1][1].worker.finish("client exit")
    slot2 = await asyncio.wait_for(second.future, 1)
    await asyncio.sleep(0.05)
    late2 = await m.begin(second, slot2, b"", 1, -1)
    late1 = await m.begin(first, slot1, b"", 1, -1)
    rec1, rec2 = m.store.started[late1.id], m.store.started[late2.id]
    assert rec1.started < rec2.started, "the lease granted first started first"
    assert rec2.started - rec1.started >= 0.04
    # Queued until the grant: the first waited less than the 0.1 s before its lease began.
    assert rec1.queued_s < rec2.queued_s and rec1.queued_s < 0.09
    assert late1.queued_s == rec1.queued_s


async def test_a_waiter_for_a_busy_gpu_does_not_block_others(mgr: Any) -> None:
    m = await mgr(2)
    await lease_on(m, 1, req=Requirements(gpu="0"))
    picky = m.enqueue(Requirements(gpu="0"), "alice", client(2))
    other = m.enqueue(Requirements(), "bob", client(3))
    await settle()
    assert not picky.future.done()
    assert (await asyncio.wait_for(other.future, 1)).gpu.index == 1


async def test_per_token_gpu_limit(mgr: Any) -> None:
    m = await mgr(2, max_gpus_per_token=1)
    await lease_on(m, 1, token="alice")
    second = m.enqueue(Requirements(), "alice", client(2))
    bob = m.enqueue(Requirements(), "bob", client(3))
    await settle()
    assert not second.future.done(), "alice already holds her one GPU"
    assert (await asyncio.wait_for(bob.future, 1)).gpu.index == 1


async def test_queue_full_and_abandon(mgr: Any) -> None:
    m = await mgr(1, max_queue=1)
    await lease_on(m, 1)
    w = m.enqueue(Requirements(), "alice", client(2))
    with pytest.raises(QueueFull, match="queue is full"):
        m.enqueue(Requirements(), "alice", client(3))
    m.abandon(w)
    assert len(m.queue) == 0
    m.enqueue(Requirements(), "alice", client(4))


async def test_abandoning_a_grant_gives_the_gpu_to_the_next(mgr: Any) -> None:
    m = await mgr(1)
    first = m.enqueue(Requirements(), "a", client(1))
    second = m.enqueue(Requirements(), "b", client(2))
    await asyncio.wait_for(first.future, 1)
    m.abandon(first)
    slot = await asyncio.wait_for(second.future, 1)
    assert slot.reserved is second and slot.state == LEASED


async def test_requirements_refused_at_once_with_reasons(mgr: Any) -> None:
    m = await mgr(gpus=[make_gpu(0, memory=40 * GIB), make_gpu(1, name="NVIDIA A100")])
    assert m.feasible(Requirements(model="a100")) is None
    why = m.feasible(Requirements(model="B200"))
    assert why is not None and "GPU 0" in why and "GPU 1" in why and "GPUPOOL_GPU_MODEL" in why
    why = m.feasible(Requirements(min_memory=60 * GIB, model="H100"))
    assert why is not None and "less than 60 GiB" in why
    w = m.enqueue(Requirements(model="A100"), "a", client(1))
    assert (await asyncio.wait_for(w.future, 1)).gpu.index == 1


async def test_failed_scrub_quarantines_until_cleared_and_persists(mgr: Any) -> None:
    m = await mgr(1)
    _, lease = await lease_on(m, 1)
    m.cleaner.results = [False]
    lease.worker.finish("client lost")
    await settle()
    slot = m.slots[0]
    assert slot.state == QUARANTINED and "ECC" in slot.quarantine["reason"]
    assert m.store.scrubbed[lease.id][0] is False
    assert m.feasible(Requirements()) is not None  # nothing can serve a client now
    for _ in range(200):  # written by a task
        if m.store.gpu_state:
            break
        await asyncio.sleep(0.01)
    saved = m.store.gpu_state
    assert saved[slot.gpu.uuid]["quarantine"]["reason"] == slot.quarantine["reason"]
    # A restarted daemon keeps it quarantined without scrubbing it.
    m2 = await mgr(1)
    assert m2.slots[0].state == QUARANTINED and m2.cleaner.cleaned == []
    with pytest.raises(LeaseError) as e:
        await m.clear(5, "admin")
    assert e.value.status == 404
    cleared = await m.clear(0, "admin")
    assert cleared is slot and cleared.state in (SCRUBBING, FREE)
    await settle()
    assert slot.state == FREE
    assert ("admin", "gpu.clear", "gpu 0") == m.store.audits[-1][:3]
    with pytest.raises(LeaseError) as e:
        await m.clear(0, "admin")
    assert e.value.status == 409


async def test_drain_waits_for_the_lease_then_undrain(mgr: Any) -> None:
    m = await mgr(1)
    _, lease = await lease_on(m, 1)
    drained = await m.drain(0, "admin")
    assert drained.draining and drained.state == LEASED
    lease.worker.finish("client exit")
    await settle()
    assert m.slots[0].state == DRAINED and m.slots[0].idle_worker is None
    w = m.enqueue(Requirements(), "a", client(2))  # feasible() would refuse; enqueue waits
    await settle()
    assert not w.future.done()
    await m.undrain(0, "admin")
    assert (await asyncio.wait_for(w.future, 1)).gpu.index == 0


async def test_operator_ends_a_lease(mgr: Any) -> None:
    m = await mgr(1)
    _, lease = await lease_on(m, 1)
    await m.end_lease(lease.id, "admin", "maintenance")
    await settle()
    assert lease.worker.ended_with is not None and "maintenance" in lease.worker.ended_with[0]
    assert m.store.ended[lease.id][0] == "revoked"
    with pytest.raises(LeaseError) as e:
        await m.end_lease(lease.id, "admin", "again")
    assert e.value.status == 404


async def test_max_lease_duration(mgr: Any) -> None:
    m = await mgr(1, max_lease_seconds=0.05)
    _, lease = await lease_on(m, 1)
    await asyncio.wait_for(asyncio.shield(lease.worker.exited), 2)
    await settle()
    assert m.store.ended[lease.id][0] == "max duration"
    assert "maximum duration" in lease.worker.ended_with[0]


async def test_worker_that_does_not_start_ends_the_lease(mgr: Any) -> None:
    m = await mgr(1)
    idle = m.slots[0].idle_worker
    idle.start_ok = False
    w = m.enqueue(Requirements(), "a", client(1))
    slot: Slot = await asyncio.wait_for(w.future, 1)
    with pytest.raises(LeaseStartError):
        await m.begin(w, slot, b"", 1, -1)
    idle.finish("worker crashed", "exit code 1")
    await settle()
    assert m.store.ended[1][0] == "not started"
    assert m.slots[0].state == FREE


async def test_open_records_of_a_dead_daemon_are_closed_and_get_the_startup_scrub(
        mgr: Any, tmp_path: Path) -> None:
    @dataclass
    class Rec:
        id: int
        gpu_index: int
        gpu_uuid: str = ""
        gpus: tuple[int, ...] = ()  # a lease of several GPUs lists them (issue 37)

    store = FakeStore(open=[Rec(7, 0), Rec(8, 1)])
    settings = Settings(state_dir=tmp_path)
    m = LeaseManager(Inventory((make_gpu(0), make_gpu(1))), settings, store,  # type: ignore[arg-type]
                     FakeSupervisor(), FakeCleaner(), Counters())  # type: ignore[arg-type]
    await m.start()
    await settle()
    try:
        assert store.ended[7][0] == "daemon lost" and store.ended[8][0] == "daemon lost"
        assert store.scrubbed[7][0] is True and store.scrubbed[8][0] is True
    finally:
        await m.close(0.1)


async def test_a_lease_ended_before_its_scrub_gets_the_startup_scrub_of_its_gpu(
        tmp_path: Path) -> None:
    @dataclass
    class Rec:
        id: int
        gpu_index: int
        gpu_uuid: str

    # Lease 5 ended on GPU 1, then the daemon was killed before the scrub; lease 6 ended on a
    # GPU this daemon no longer serves (its record stays pending, nothing scrubs it).
    store = FakeStore(unscrubbed=[Rec(5, 1, make_gpu(1).uuid), Rec(6, 9, "GPU-gone")])
    cleaner = FakeCleaner()
    m = LeaseManager(Inventory((make_gpu(0), make_gpu(1))), Settings(state_dir=tmp_path), store,  # type: ignore[arg-type]
                     FakeSupervisor(), cleaner, Counters())  # type: ignore[arg-type]
    await m.start()
    await settle()
    try:
        assert store.scrubbed == {5: (True, store.scrubbed[5][1])}
        assert store.scrubbed[5][1]["scrub"]["bytes"] == 123 and sorted(cleaner.cleaned) == [0, 1]
        assert store.ended == {}  # its end stays as the previous daemon recorded it
    finally:
        await m.close(0.1)


async def test_a_moved_lease_ended_before_its_scrub_gets_the_startup_scrub_of_its_last_gpu(
        tmp_path: Path) -> None:
    """Lease 5 started on GPU 0, came back on GPU 1 after an idle detach and ended there before
    its scrub: GPU 1's start-up scrub is its scrub, not GPU 0's (its record names GPU 0)."""
    @dataclass
    class Rec:
        id: int
        gpu_index: int
        gpu_uuid: str

    class GpuNamingCleaner(FakeCleaner):
        async def clean(self, gpu: Gpu) -> CleanResult:
            r = await super().clean(gpu)
            return CleanResult(ok=r.ok, problems=r.problems, scrub={**r.scrub, "gpu": gpu.index})

    store = FakeStore(unscrubbed=[Rec(5, 0, make_gpu(0).uuid)],
                      events={5: [("detached", 0, "idle", 1), ("attached", 1, "moved", 1)]})
    m = LeaseManager(Inventory((make_gpu(0), make_gpu(1))), Settings(state_dir=tmp_path), store,  # type: ignore[arg-type]
                     FakeSupervisor(), GpuNamingCleaner(), Counters())  # type: ignore[arg-type]
    await m.start()
    await settle()
    try:
        assert store.scrubbed[5][1]["scrub"]["gpu"] == 1, store.scrubbed
    finally:
        await m.close(0.1)


class BusyWorkerSupervisor(FakeSupervisor):
    """A previous daemon's worker that answers its adoption only once `answer` is set (busy in
    a call, as after a restart during a long kernel), on the GPU of UUID `uuid`."""

    def __init__(self, uuid: str) -> None:
        super().__init__()
        self.uuid = uuid
        self.answer = asyncio.Event()
        self.adopted_on: list[int] = []  # the GPU each adoption was started for (its log's)

    @staticmethod
    async def connect_adoption(path: Path) -> tuple[Any, int]:
        return object(), 4242

    async def adopt(self, gpu: Gpu, sock: Any, pid: int, max_wait: float = 0.0) -> FakeWorker:
        self.adopted_on.append(gpu.index)
        await self.answer.wait()
        w = FakeWorker(gpu)
        w.session_id, w.adoptable = 7, True
        w.uuid, w.request, w.orphaned_s, w.adopted_detached = self.uuid, {}, 1.0, None  # type: ignore[attr-defined]
        self.spawned.append(w)
        return w


async def test_a_lease_that_moved_is_taken_over_on_the_gpu_its_events_say_while_its_worker_is_busy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lease 7 started on GPU 0, detached and came back on GPU 1 (its record still says GPU 0:
    it is the history's first stretch). Its worker, busy in a call, answers after start-up: GPU 1
    must be kept for it meanwhile, and GPU 0 put in service."""
    monkeypatch.setattr("gpupoold.pool.leases.ADOPT_PEEK", 0.05)
    gpus = (make_gpu(0), make_gpu(1))
    rec = LeaseRecord(gpu_index=0, gpu_uuid=gpus[0].uuid, gpu_name=gpus[0].name, simulated=True,
                      token_name="alice", client_host="h", client_user="u", client_pid=9,
                      program="p", peer="10.0.0.9:1", request="", queued_s=0.0, started=1.0,
                      id=7, ended=None, end_reason=None, end_detail=None, bytes_h2d=0,
                      bytes_d2h=0, calls={}, scrub_ok=None, scrub=None, detaches=1)
    store = FakeStore(open=[rec], events={7: [("detached", 0, "idle", 1),
                                              ("attached", 1, "moved from GPU 0", 1)]})
    supervisor = BusyWorkerSupervisor(gpus[1].uuid)
    m = LeaseManager(Inventory(gpus), Settings(state_dir=tmp_path), store,  # type: ignore[arg-type]
                     supervisor, FakeCleaner(), Counters())  # type: ignore[arg-type]
    await m.start()
    try:
        await wait_for_state(m, 0, FREE)
        assert m.slots[1].state == LEASED and m.slots[1].adopting == 7, m.slots[1]
        assert supervisor.adopted_on == [1]
        supervisor.answer.set()
        for _ in range(100):
            if m.pool.lease(7) is not None:
                break
            await asyncio.sleep(0.01)
        lease = m.pool.lease(7)
        assert lease is not None and lease.slot is m.slots[1] and m.slots[1].lease is lease
        assert store.ended == {} and m.slots[0].state == FREE
    finally:
        await m.close(0.1)


async def test_close_refuses_waiters_and_records_daemon_stopped(mgr: Any) -> None:
    m = await mgr(1)
    _, lease = await lease_on(m, 1)
    w = m.enqueue(Requirements(), "a", client(2))
    await m.close(0.1)
    assert w.future.done() and w.future.exception() is not None
    assert m.store.ended[lease.id][0] == "daemon stopped"
    assert m.supervisor.stopped


# ------------------------------------------------------------------ bookkeeping failures, watchdog
async def wait_for_state(m: LeaseManager, index: int, state: str, timeout: float = 3.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while m.slots[index].state != state:
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"GPU {index} is {m.slots[index].state}, not {state}, after "
                                 f"{timeout} s")
        await asyncio.sleep(0.01)


async def test_a_failing_lease_record_still_returns_the_gpu_scrubbed(mgr: Any) -> None:
    m = await mgr(1)
    _, lease = await lease_on(m, 1)

    async def broken(*args: Any, **kwargs: Any) -> None:
        raise OverflowError("Python int too large to convert to SQLite INTEGER")

    m.store.lease_ended = broken
    lease.worker.finish("client lost", bytes_h2d=1 << 63)
    await settle()
    assert m.slots[0].state == FREE and m.cleaner.cleaned == [0, 0]
    assert m.store.scrubbed[lease.id][0] is True
    assert m.lease(lease.id) is None and m.slots[0].lease is None
    assert PoolViews(m).summary()["stuck"] == []
    # The next client gets the GPU.
    _, again = await lease_on(m, 2)
    assert again.slot is m.slots[0]


async def test_a_failing_cleaner_quarantines_instead_of_leaving_the_gpu_scrubbing(mgr: Any) -> None:
    m = await mgr(1)
    _, lease = await lease_on(m, 1)

    async def broken(gpu: Gpu) -> CleanResult:
        raise RuntimeError("simulated cleaner bug")

    m.cleaner.clean = broken
    lease.worker.finish("client exit")
    await settle()
    assert m.slots[0].state == QUARANTINED
    assert "simulated cleaner bug" in m.slots[0].quarantine["reason"]


async def test_watchdog_repairs_a_lease_nobody_watches(mgr: Any) -> None:
    m = await mgr(1)
    _, lease = await lease_on(m, 1)
    slot = m.slots[0]
    assert slot.task is not None
    slot.task.cancel()  # as if the watcher had died of a bug
    await settle()
    assert m.stuck_reason(slot) == f"lease {lease.id} has nobody watching its worker"
    # Reported at the first check, repaired at the second: a new watcher follows the worker.
    await asyncio.sleep(0.75)
    assert PoolViews(m).summary()["stuck"] and PoolViews(m).summary()["stuck"][0]["gpu"] == 0
    await asyncio.sleep(0.6)
    assert slot.task is not None and not slot.task.done()
    assert PoolViews(m).summary()["stuck"] == [] and m.counters.get("watchdog_repairs") == 1
    lease.worker.finish("client exit")
    await wait_for_state(m, 0, FREE)
    assert m.store.ended[lease.id][0] == "client exit"


async def test_watchdog_scrubs_a_gpu_leased_with_no_lease(mgr: Any) -> None:
    m = await mgr(1)
    slot = m.slots[0]
    slot.state = LEASED  # a bug's doing (no transition leads there): what the watchdog repairs
    await wait_for_state(m, 0, FREE, timeout=3)
    assert m.cleaner.cleaned == [0, 0]
    assert m.counters.get("watchdog_repairs") == 1


async def test_watchdog_leaves_a_gpu_alone_while_its_ended_lease_is_recorded(mgr: Any) -> None:
    """Between a lease's end and its GPU's scrub the watcher records the end in the store (a
    thread; PostgreSQL over the network): the GPU is leased with no lease meanwhile, which is no
    fault (CI's sanitizer tier once caught a watchdog tick in that window and reported a stuck
    GPU)."""
    m = await mgr(1)
    recorded = asyncio.Event()
    ended = m.store.lease_ended

    async def slow_lease_ended(*args: Any, **kwargs: Any) -> None:
        await recorded.wait()
        await ended(*args, **kwargs)

    m.store.lease_ended = slow_lease_ended
    _, lease = await lease_on(m, 1)
    slot = m.slots[0]
    lease.worker.finish("client exit")
    for _ in range(200):
        if slot.lease is None and slot.ended_at is not None:
            break
        await asyncio.sleep(0.01)
    assert slot.lease is None and slot.ended_at is not None, "the lease did not end"
    await asyncio.sleep(1.2)  # two watchdog ticks
    assert slot.state == LEASED and m.stuck_reason(slot) is None
    assert PoolViews(m).summary()["stuck"] == [] and m.counters.get("watchdog_repairs") == 0
    # Past the limit it is a fault.
    slot.ended_at -= 61.0
    assert m.stuck_reason(slot) == "leased, but no lease holds it"
    slot.ended_at += 61.0
    recorded.set()
    await wait_for_state(m, 0, FREE)
    assert slot.ended_at is None and m.store.ended[lease.id][0] == "client exit"


async def test_watchdog_quarantines_a_gpu_it_keeps_repairing(mgr: Any) -> None:
    m = await mgr(1)
    slot = m.slots[0]
    for _ in range(4):
        slot.state = SCRUBBING  # a bug's doing: scrubbing with no scrub running, again and again
        slot.task = None
        await asyncio.sleep(1.2)
        if slot.state == QUARANTINED:
            break
    assert slot.state == QUARANTINED
    assert "watchdog repaired this GPU 4 times" in slot.quarantine["reason"]
    assert m.feasible(Requirements()) is not None  # no GPU in service: refused, not queued


async def test_close_leaves_adoptable_leases_running_and_open(mgr: Any) -> None:
    """A worker that can outlive the daemon is detached, not stopped: its lease stays open in
    the store for the next gpupoold (tests/test_e2e_restarts.py takes it over)."""
    m = await mgr(2)
    _, kept = await lease_on(m, 1)
    _, ended = await lease_on(m, 2)
    kept.worker.adoptable = True
    await m.close(0.1)
    assert kept.worker.detached and not kept.worker.exited.done()
    assert kept.id not in m.store.ended
    assert m.store.ended[ended.id][0] == "daemon stopped"


async def test_the_state_file_of_an_older_gpupoold_is_imported_once(mgr: Any, tmp_path: Path,
                                                                    caplog: Any) -> None:
    """Drained and quarantined GPUs were kept in <state_dir>/gpu-state.json before the store
    had them: the first start imports the file into the store and removes it."""
    legacy = tmp_path / "gpu-state.json"
    legacy.write_text(json.dumps({
        make_gpu(0).uuid: {"draining": False, "quarantine": {"reason": "XID 79", "since": 5.0}},
        make_gpu(1).uuid: {"draining": True, "quarantine": None}}))
    with caplog.at_level("INFO", logger="gpupoold.leases"):
        m = await mgr(2)
    assert m.slots[0].state == QUARANTINED and m.slots[0].quarantine["reason"] == "XID 79"
    assert m.slots[1].state == DRAINED and m.slots[1].draining
    assert not legacy.exists() and "imported into the database" in caplog.text
    assert m.store.gpu_state[make_gpu(1).uuid]["draining"] is True
    # The next start reads the store alone.
    m2 = await mgr(2)
    assert (m2.slots[0].state, m2.slots[1].state) == (QUARANTINED, DRAINED)


async def test_an_unreadable_state_file_is_left_in_place(mgr: Any, tmp_path: Path,
                                                         caplog: Any) -> None:
    legacy = tmp_path / "gpu-state.json"
    legacy.write_text("{not json")
    with caplog.at_level("ERROR", logger="gpupoold.leases"):
        m = await mgr(1)
    assert legacy.exists() and "left in place" in caplog.text
    assert m.slots[0].state == FREE
