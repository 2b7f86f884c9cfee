"""Restart take-over of the shares of a shared GPU (issue 32): a restarted gpupoold knows a
previous lease was a share by its worker's word (worker_adopted's memory_quota), takes every
running share of a GPU over as a share of that GPU (none scrubbed, none given whole, their quotas
counted), scrubs the GPU whole only after the last of them ends, and takes a detached share over
detached as a share, which comes back through the share placement. The lease manager with the
fakes of tests/test_leases.py; the end-to-end check is tests/test_e2e_restart_shares.py."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import gpupool_protocol as gp
import pytest
from test_detach import FakeCheckpointer
from test_leases import GIB, FakeCleaner, FakeStore, FakeSupervisor, FakeWorker, client, lease_on, make_gpu, mgr  # noqa: F401 (mgr: a fixture)
from test_takeover_multi_gpu import until

from gpupoold.config.settings import Settings
from gpupoold.gpu.inventory import Inventory
from gpupoold.pool.counters import Counters
from gpupoold.pool.leases import LeaseManager
from gpupoold.pool.requirements import Requirements
from gpupoold.pool.share_leases import MPS_SHARE_KEEPS_GPU
from gpupoold.pool.slots import ATTACHED, ATTACHING, DETACHED, FREE, LEASED
from gpupoold.pool.takeover import KEEPS_GPU_ASKED
from gpupoold.store.records import LeaseRecord
from gpupoold.workers.supervisor import AdoptError

A, B, C = 11, 12, 13  # two shares running on GPU 0, one detached from it


@pytest.fixture(autouse=True)
def fake_workers_are_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The take-over tells an adopted worker from an AdoptError by its class."""
    for module in ("gpupoold.pool.leases", "gpupoold.pool.takeover"):
        monkeypatch.setattr(f"{module}.Worker", FakeWorker)


class PreviousShares(FakeSupervisor):
    """The previous daemon's workers, lease id -> (its GPU's UUID, its memory quota, the bytes
    it saved when detached or None): each listens on its adoption socket and answers at once."""

    def __init__(self, workers: dict[int, tuple[str, int, int | None]],
                 flags: dict[int, int] | None = None) -> None:
        super().__init__()
        self.workers = workers
        self.flags = flags or {}  # lease id -> its worker_adopted's flags (none: an older one)
        self.retired: list[int] = []

    async def connect_adoption(self, path: Path) -> tuple[Any, int]:  # type: ignore[override]
        lease_id = int(path.name.removeprefix("lease-").removesuffix(".sock"))
        if lease_id not in self.workers:
            raise AdoptError(f"no worker listens on {path}")
        return lease_id, 5000 + lease_id

    async def adopt(self, gpu: Any, sock: Any, pid: int, max_wait: float = 0.0) -> FakeWorker:
        uuid, quota, detached = self.workers[sock]
        w = FakeWorker(gpu)
        w.pid, w.session_id, w.adoptable = pid, sock, True
        w.uuid, w.orphaned_s = uuid, 1.0  # type: ignore[attr-defined]
        w.request = {"gpu": "", "model": "", "min_memory": 0, "memory": quota}  # type: ignore[attr-defined]
        w.adopted_detached = detached  # type: ignore[attr-defined]
        w.adopted_flags = self.flags.get(sock, 0)  # type: ignore[attr-defined]
        self.spawned.append(w)
        return w

    async def retire(self, worker: FakeWorker) -> None:
        self.retired.append(worker.session_id or 0)
        worker.finish("server ended")


def record(lease_id: int, gpu: int = 0) -> LeaseRecord:
    return LeaseRecord(gpu_index=gpu, gpu_uuid=make_gpu(gpu).uuid, gpu_name=make_gpu(gpu).name,
                       simulated=True, token_name="alice", client_host="h", client_user="u",
                       client_pid=lease_id, program="p", peer="10.0.0.9:1",
                       request="8 GiB of memory", queued_s=0.0, started=1.0, id=lease_id,
                       ended=None, end_reason=None, end_detail=None, bytes_h2d=0, bytes_d2h=0,
                       calls={}, scrub_ok=None, scrub=None)


async def restarted(tmp_path: Path, workers: dict[int, tuple[str, int, int | None]],
                    events: dict[int, Any] | None = None, flags: dict[int, int] | None = None,
                    **settings: Any) -> LeaseManager:
    """A gpupoold of 2 GPUs of 32 GiB, GPU 0 shared 2 ways (unless `settings` say otherwise),
    starting where the previous one left `workers`' leases open (their worker_adopted flags:
    `flags`)."""
    store = FakeStore(open=[record(i) for i in sorted(workers)], events=events or {})
    inventory = Inventory((make_gpu(0, memory=32 * GIB), make_gpu(1, memory=32 * GIB)))
    m = LeaseManager(inventory, Settings(state_dir=tmp_path, **{"share": 2, "share_gpus": [0],
                                                               **settings}),
                     store, PreviousShares(workers, flags), FakeCleaner(), Counters())  # type: ignore[arg-type]
    m.detacher.checkpointer = FakeCheckpointer()  # type: ignore[assignment]
    await m.start()
    return m


def on_gpu0(quota_gib: int, detached: int | None = None) -> tuple[str, int, int | None]:
    return make_gpu(0).uuid, quota_gib * GIB, detached


async def test_running_and_detached_shares_are_taken_over_as_shares(tmp_path: Path) -> None:
    m = await restarted(tmp_path, {A: on_gpu0(8), B: on_gpu0(4), C: on_gpu0(8, detached=GIB)},
                        events={C: [(DETACHED, 0, "idle", 1)]})
    slot = m.slots[0]
    try:
        await until("both running shares taken over", lambda: len(slot.shares) == 2)
        await until("GPU 1 scrubbed", lambda: m.slots[1].state == FREE)
        a, b, c = m.pool.lease(A), m.pool.lease(B), m.pool.lease(C)
        assert a is not None and b is not None and c is not None
        # Both are shares of GPU 0, their quotas counted; the GPU neither scrubbed nor whole.
        assert slot.state == LEASED and slot.lease is None and slot.adopting is None
        assert slot.shares == [a, b] and a.share and b.share and a.slot is b.slot is slot
        assert slot.share_quotas() == {A: 8 * GIB, B: 4 * GIB}
        assert m.cleaner.cleaned == [1] and m.store.ended == {}
        assert m.supervisor.retired == []  # type: ignore[attr-defined]
        # The detached one is a share, away, its quota kept.
        assert c.state == DETACHED and c.share and c.slot is None and c.home is slot.gpu
        assert c.req.memory == 8 * GIB
        # A whole-GPU client gets GPU 1, never GPU 0 while its shares run.
        whole = m.enqueue(Requirements(), "bob", client(1))
        assert (await asyncio.wait_for(whole.future, 1)) is m.slots[1]
        # A's client leaves: its memory was zeroed by its worker, no scrub; the detached share
        # comes back in its place through the share placement.
        a.worker.finish("client exit")
        await until("A ended", lambda: A in m.store.ended)
        assert m.cleaner.cleaned == [1] and slot.shares == [b]
        c.worker.wants_gpu.set()
        await until("C back as a share of GPU 0", lambda: c.state == ATTACHED)
        assert slot.shares == [b, c] and slot.lease is None and m.cleaner.cleaned == [1]
        # The last share's end scrubs the GPU whole, once.
        b.worker.finish("client exit")
        await asyncio.sleep(0.05)
        assert m.cleaner.cleaned == [1] and slot.state == LEASED
        c.worker.finish("client exit")
        await until("GPU 0 scrubbed whole and free", lambda: slot.state == FREE)
        assert m.cleaner.cleaned == [1, 0] and m.store.scrubbed[C][0] is True
    finally:
        await m.close(0.1)


async def test_a_share_not_taken_over_closes_its_gpu_until_the_others_end(
        tmp_path: Path) -> None:
    """B's worker runs on a GPU this server does not have: B ends (retired, its record closed), A runs on as a
    share, and since nothing says B's memory was zeroed, no new share lands on GPU 0 until it
    is scrubbed whole after A."""
    m = await restarted(tmp_path, {A: on_gpu0(8), B: (make_gpu(7).uuid, 8 * GIB, None)})
    slot = m.slots[0]
    try:
        await until("A taken over", lambda: m.pool.lease(A) is not None)
        await until("B's record closed", lambda: B in m.store.ended)
        a = m.pool.lease(A)
        assert a is not None and slot.shares == [a] and slot.share_closed
        assert m.supervisor.retired == [B]  # type: ignore[attr-defined]
        assert "could not take over the share" in m.store.ended[B][1]
        share = m.enqueue(Requirements(memory=8 * GIB), "bob", client(2))
        await asyncio.sleep(0.05)
        assert not share.future.done()
        a.worker.finish("client exit")
        assert (await asyncio.wait_for(share.future, 2)) is slot  # after the whole scrub
        assert 0 in m.cleaner.cleaned and not slot.share_closed
    finally:
        await m.close(0.1)


async def test_shares_on_a_gpu_this_configuration_does_not_share_run_on_alone(
        tmp_path: Path) -> None:
    """The restarted daemon shares no GPU: both shares are taken over as shares all the same,
    and GPU 0 takes nobody else until they end and it is scrubbed whole; a single lease with a
    quota on an unshared GPU is a whole-GPU lease, as before."""
    m = await restarted(tmp_path, {A: on_gpu0(8), B: on_gpu0(8)}, share=1, share_gpus=[])
    slot = m.slots[0]
    try:
        await until("both taken over", lambda: len(slot.shares) == 2)
        a, b = m.pool.lease(A), m.pool.lease(B)
        assert a is not None and b is not None and a.share and b.share
        first = m.enqueue(Requirements(), "bob", client(1))
        assert (await asyncio.wait_for(first.future, 1)) is m.slots[1]
        second = m.enqueue(Requirements(memory=4 * GIB), "bob", client(2))
        await asyncio.sleep(0.05)
        assert not second.future.done()  # GPU 0 is not lent while its shares run
        a.worker.finish("client exit")
        b.worker.finish("client exit")
        assert (await asyncio.wait_for(second.future, 2)) is slot
        assert m.cleaner.cleaned.count(0) == 1
    finally:
        await m.close(0.1)
    m = await restarted(tmp_path, {A: on_gpu0(8)}, share=1, share_gpus=[])
    try:
        await until("A taken over", lambda: m.pool.lease(A) is not None)
        a = m.pool.lease(A)
        assert a is not None and not a.share and m.slots[0].lease is a
        assert a.req.memory == 8 * GIB
    finally:
        await m.close(0.1)


async def test_a_share_being_restored_is_not_kept_at_a_clean_stop(
        mgr: Any, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    """A detached share whose client called again is granted its place through the GPU's share
    grants and restored there: at a stop meanwhile its worker ends (the driver's state of its
    process is not known), as a whole-GPU lease being restored does; while it is granted, its
    token holds that one place, not two (max_gpus_per_token leaves its own grant out)."""
    m = await mgr(gpus=[make_gpu(0, memory=16 * GIB)], share=2, idle_detach_after=0.05)
    checkpointer = FakeCheckpointer()
    restore = asyncio.Event()
    attach = checkpointer.attach

    async def slow_attach(gpu: Any, pid: int, moves: Any) -> Any:
        await restore.wait()
        return await attach(gpu, pid, moves)

    checkpointer.attach = slow_attach  # type: ignore[method-assign]
    m.detacher.checkpointer = checkpointer
    slot = m.slots[0]
    _, a = await lease_on(m, 1, req=Requirements(memory=8 * GIB))
    _, b = await lease_on(m, 2, token="bob", req=Requirements(memory=8 * GIB))
    b.keep_gpu = "test: busy"
    a.worker.adoptable = True
    a.worker.wants_gpu.clear()
    carol = m.enqueue(Requirements(memory=8 * GIB), "carol", client(3))
    assert await asyncio.wait_for(carol.future, 3) is slot  # A was detached for her
    assert a.state == DETACHED
    m.abandon(carol)  # she leaves: A's place is free again
    a.worker.wants_gpu.set()
    await until("A granted its place, being restored", lambda: a.state == ATTACHING and any(
        w.returning == a.id for w in slot.share_grants))
    assert m.pool.held("alice", but=a.id) == 0 and m.pool.held("alice") == 1
    caplog.set_level(logging.WARNING)
    await m.close(0.1)
    assert not any("continue without gpupoold" in r.getMessage() for r in caplog.records)


D = 14  # a share of GPU 0 whose worker died while gpupoold was down


async def test_a_share_that_died_while_gpupoold_was_down_closes_its_gpu(tmp_path: Path) -> None:
    """A runs on: it is taken over as a share. D's worker is gone (nothing zeroed its memory):
    its record says GPU 0 is scrubbed whole when its other shares end, and until then GPU 0 takes
    no new share, also across a further restart (the store keeps the GPU closed)."""
    store = FakeStore(open=[record(A), record(D)], events={})
    inventory = Inventory((make_gpu(0, memory=32 * GIB), make_gpu(1, memory=32 * GIB)))
    settings = Settings(state_dir=tmp_path, share=2, share_gpus=[0])
    m = LeaseManager(inventory, settings, store, PreviousShares({A: on_gpu0(8)}),  # type: ignore[arg-type]
                     FakeCleaner(), Counters())
    m.detacher.checkpointer = FakeCheckpointer()  # type: ignore[assignment]
    await m.start()
    slot = m.slots[0]
    try:
        await until("A taken over", lambda: len(slot.shares) == 1)
        assert slot.share_closed and 0 not in m.cleaner.cleaned
        assert "scrubbed whole when the leases taken over on it" in store.ended[D][1]
        await until("kept closed in the store", lambda: store.gpu_state.get(
            make_gpu(0).uuid, {}).get("share_closed") is True)
        share = m.enqueue(Requirements(memory=4 * GIB), "bob", client(2))
        await asyncio.sleep(0.05)
        assert not share.future.done()  # 8 + 4 of 32 GiB: room, but D's memory may be there
    finally:
        await m.close(0.1)
    # Restarted again, A still running: GPU 0 stays closed until A ends and it is scrubbed.
    store.open, store.ended = [record(A)], {}
    m = LeaseManager(inventory, settings, store, PreviousShares({A: on_gpu0(8)}),  # type: ignore[arg-type]
                     FakeCleaner(), Counters())
    m.detacher.checkpointer = FakeCheckpointer()  # type: ignore[assignment]
    await m.start()
    slot = m.slots[0]
    try:
        await until("A taken over again", lambda: len(slot.shares) == 1)
        assert slot.share_closed
        share = m.enqueue(Requirements(memory=4 * GIB), "bob", client(2))
        await asyncio.sleep(0.05)
        assert not share.future.done()
        a = m.pool.lease(A)
        assert a is not None
        a.worker.finish("client exit")
        assert (await asyncio.wait_for(share.future, 2)) is slot  # after the whole scrub
        assert 0 in m.cleaner.cleaned and not slot.share_closed
        await until("opened in the store", lambda: "share_closed" not in store.gpu_state.get(
            make_gpu(0).uuid, {}))
    finally:
        await m.close(0.1)


SAID, SHARE, KEEP = gp.GP_ADOPTED_SAID, gp.GP_ADOPTED_SHARE, gp.GP_ADOPTED_KEEP_GPU


async def test_a_taken_over_share_keeps_its_gpu_as_its_client_and_mps_ask(tmp_path: Path) -> None:
    """Never idle-detached after the take-over when its client asked to keep its GPU (its
    worker says so), nor under share_mps (a share in the MPS server keeps its place)."""
    m = await restarted(tmp_path, {A: on_gpu0(8), B: on_gpu0(4)},
                        flags={A: SAID | SHARE | KEEP, B: SAID | SHARE})
    try:
        await until("taken over", lambda: len(m.slots[0].shares) == 2)
        a, b = m.pool.lease(A), m.pool.lease(B)
        assert a is not None and b is not None
        assert a.keep_gpu == KEEPS_GPU_ASKED and b.keep_gpu is None
    finally:
        await m.close(0.1)
    m = await restarted(tmp_path, {A: on_gpu0(8), B: on_gpu0(4)},
                        flags={A: SAID | SHARE, B: SAID | SHARE}, share_mps=str(tmp_path))
    try:
        await until("taken over under MPS", lambda: len(m.slots[0].shares) == 2)
        assert all(le is not None and le.keep_gpu == MPS_SHARE_KEEPS_GPU
                   for le in (m.pool.lease(A), m.pool.lease(B)))
    finally:
        await m.close(0.1)


async def test_a_whole_gpu_lease_with_a_memory_cap_is_taken_over_whole(tmp_path: Path) -> None:
    """A whole-GPU lease with a quota (GPUPOOL_MEMORY on an unshared GPU) stays whole when the
    new configuration shares its GPU: its worker says it did not run as a share. A worker from
    before the flags says nothing: its quota makes it a share, as before."""
    m = await restarted(tmp_path, {A: on_gpu0(8)}, flags={A: SAID})
    try:
        await until("A taken over", lambda: m.pool.lease(A) is not None)
        a = m.pool.lease(A)
        assert a is not None and not a.share and m.slots[0].lease is a and not m.slots[0].shares
    finally:
        await m.close(0.1)
    m = await restarted(tmp_path, {A: on_gpu0(8)})
    try:
        await until("A taken over", lambda: m.pool.lease(A) is not None)
        a = m.pool.lease(A)
        assert a is not None and a.share and m.slots[0].shares == [a]
    finally:
        await m.close(0.1)
