"""Idle detach of a share of a shared GPU (issue 32, item 5) in the lease manager, with fake
workers and checkpoints (tests/test_leases.py's, tests/test_detach.py's): a share that detaches
frees its place for another share with no scrub, comes back through the share placement (on the
GPU it left when it has room, else on another shared GPU, moved), and a whole-GPU waiter that
claimed a shared GPU has its shares asked at once rather than after the idle timeout. The
end-to-end test is tests/test_e2e_share_detach.py."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import gpupool_protocol as gp
from test_detach import FakeCheckpointer, until
from test_leases import GIB, client, lease_on, make_gpu, mgr, settle  # noqa: F401 (fixture)

from gpupoold.gpu.checkpoint import CheckpointResult
from gpupoold.pool.detach import DRAIN_IDLE_S
from gpupoold.pool.requirements import Requirements
from gpupoold.pool.share_leases import MPS_SHARE_KEEPS_GPU
from gpupoold.pool.shares import GpuRoom, Request, ShareSettings, plan
from gpupoold.pool.slots import ATTACHED, DETACHED, FREE, LEASED
from gpupoold.pool.views import PoolViews


def share(gib: int) -> Requirements:
    return Requirements(memory=gib * GIB)


async def shared(mgr: Any, gpus: int = 1, **settings: Any) -> Any:  # noqa: F811
    m = await mgr(gpus=[make_gpu(i, memory=16 * GIB) for i in range(gpus)], share=2,
                  **{"idle_detach_after": 0.05, **settings})
    m.detacher.checkpointer = FakeCheckpointer()
    return m


def asked_with(worker: Any) -> list[int]:
    """Record the idle time (ms) `worker` is asked for."""
    asks: list[int] = []
    answer = worker.ask_detach

    async def ask(idle_ms: int) -> Any:
        asks.append(idle_ms)
        return await answer(idle_ms)

    worker.ask_detach = ask
    return asks


async def test_an_idle_share_leaves_its_place_to_a_waiting_share_and_comes_back_there(mgr: Any) -> None:  # noqa: F811
    m = await shared(mgr)  # when-queued: it detaches for the share that waits
    slot = m.slots[0]
    _, a = await lease_on(m, 1, req=share(8))
    _, b = await lease_on(m, 2, req=share(8))
    assert a.share and a.keep_gpu is None and slot.shares == [a, b]
    b.keep_gpu = "test: stays"
    m.cleaner.cleaned.clear()
    wc = m.enqueue(share(8), "carol", client(3))  # the GPU takes two shares: it waits
    assert await asyncio.wait_for(wc.future, 3) is slot
    assert a.state == DETACHED and a.slot is None and a.home is slot.gpu
    assert m.detacher.checkpointer.calls == [("detach", 0, a.worker.pid)]
    assert m.cleaner.cleaned == []  # no scrub: b still runs there; a's memory left zeroed
    c = await m.begin(wc, slot, b"hello", 1, -1)
    c.keep_gpu = "test: stays"
    assert slot.shares == [b, c] and slot.state == LEASED
    views = PoolViews(m)
    assert [e["id"] for e in views.gpu_views()[0]["shares"]["leases"]] == [b.id, c.id]
    assert views.lease(a)["detach"]["state"] == DETACHED and views.lease(a)["gpu"] is None
    assert views.lease(a)["memory_quota"] == 8 * GIB  # its quota, kept while it is away

    a.worker.wants_gpu.set()  # its client calls: no room (two shares) until c ends
    await until("a queued", lambda: len(m.queue) == 1)
    await asyncio.sleep(0.1)
    assert a.state != ATTACHED and m.queue.first(lambda w: True).returning == a.id
    c.worker.finish("client exit")
    await until("a attached", lambda: a.state == ATTACHED)
    assert a.slot is slot and slot.shares == [b, a] and not slot.share_grants
    assert m.detacher.checkpointer.calls[-1] == ("attach", 0, a.worker.pid, ())
    assert m.cleaner.cleaned == []  # never scrubbed whole: a share was on it all along
    b.worker.finish("client exit")
    a.worker.finish("client exit")
    await until("scrubbed whole and free", lambda: slot.state == FREE)
    assert m.cleaner.cleaned == [0]


async def test_a_share_whose_gpu_is_full_comes_back_on_another_shared_gpu(mgr: Any) -> None:  # noqa: F811
    m = await shared(mgr, 2, detach_policy="always")
    _, a = await lease_on(m, 1, req=share(8))
    _, b = await lease_on(m, 2, req=share(8))
    b.keep_gpu = "test: stays"
    assert a.slot is b.slot is m.slots[0]
    await until("a detached", lambda: a.state == DETACHED)
    _, d = await lease_on(m, 4, req=share(8))  # a's place on GPU 0 (first fit): it is full
    d.keep_gpu = "test: stays"
    assert d.slot is m.slots[0]
    a.worker.wants_gpu.set()
    await until("a attached", lambda: ("attach", 1, a.worker.pid,
                                       ((m.slots[0].gpu.uuid, m.slots[1].gpu.uuid),))
                in m.detacher.checkpointer.calls)
    assert ("attached", m.slots[1].gpu.uuid, "True") in a.worker.told


async def test_the_last_share_to_detach_leaves_its_gpu_scrubbed_whole(mgr: Any) -> None:  # noqa: F811
    m = await shared(mgr, detach_policy="always")
    _, a = await lease_on(m, 1, req=share(8))
    m.cleaner.cleaned.clear()
    await until("a detached", lambda: a.state == DETACHED)
    await until("GPU 0 free", lambda: m.slots[0].state == FREE)
    assert m.cleaner.cleaned == [0] and m.store.scrubbed[a.id][0] is True


async def test_a_share_whose_restore_fails_ends_and_closes_its_gpu_until_the_whole_scrub(mgr: Any) -> None:  # noqa: F811
    """A restore that failed may have left part of the share's memory on the GPU, unzeroed: as
    after a share's worker died, no new share lands there until the GPU is scrubbed whole."""
    m = await shared(mgr, detach_policy="always")
    slot = m.slots[0]
    _, a = await lease_on(m, 1, req=share(8))
    _, b = await lease_on(m, 2, req=share(8))
    b.keep_gpu = "test: stays"
    await until("a detached", lambda: a.state == DETACHED)
    m.detacher.checkpointer.attach_result = CheckpointResult(False, 0.1, error="restore failed")
    m.cleaner.cleaned.clear()
    a.worker.wants_gpu.set()
    await until("a ended", lambda: a.id in m.store.ended)
    assert m.store.ended[a.id][0] == "worker error" and slot.share_closed
    assert slot.shares == [b] and not slot.share_grants and m.cleaner.cleaned == []
    wc = m.enqueue(share(8), "carol", client(3))
    await settle()
    assert not wc.future.done()  # room, but closed
    b.worker.finish("client exit")
    assert await asyncio.wait_for(wc.future, 3) is slot
    assert m.cleaner.cleaned == [0] and not slot.share_closed


async def test_a_share_whose_client_leaves_while_it_is_parked_closes_its_gpu(mgr: Any) -> None:  # noqa: F811
    """A parked worker exits without a driver call (worker/prestart.c): a share whose client
    left while its checkpoint ran (which fails then) leaves its memory unzeroed, so its GPU takes
    no new share until it is scrubbed whole; another share's end keeps it open."""
    m = await shared(mgr)
    slot = m.slots[0]
    _, a = await lease_on(m, 1, req=share(8))
    _, b = await lease_on(m, 2, req=share(8))
    b.keep_gpu = "test: stays"

    class ClientLeaves(FakeCheckpointer):
        async def detach(self, gpu: Any, pid: int) -> CheckpointResult:
            await super().detach(gpu, pid)
            a.worker.finish("client exit")
            return CheckpointResult(False, 0.0, error="no such process")

    m.detacher.checkpointer = ClientLeaves()
    m.cleaner.cleaned.clear()
    wc = m.enqueue(share(8), "carol", client(3))
    await until("a ended", lambda: a.id in m.store.ended)
    await settle()
    assert slot.share_closed and slot.shares == [b] and not wc.future.done()
    b.worker.finish("client exit")
    assert await asyncio.wait_for(wc.future, 3) is slot
    assert m.cleaner.cleaned == [0]


async def test_a_share_that_cannot_detach_keeps_its_place(mgr: Any) -> None:  # noqa: F811
    m = await shared(mgr)
    _, a = await lease_on(m, 1, req=share(8))
    _, b = await lease_on(m, 2, req=share(8))
    a.worker.idle_answer = gp.WorkerDetachNo(session_id=0, lasting=1, idle_ms=0,
                                             why="the program shares device memory through "
                                             "CUDA IPC")
    b.worker.idle_answer = gp.WorkerDetachNo(session_id=0, lasting=0, idle_ms=0,
                                             why="a call is being served")
    wc = m.enqueue(share(8), "carol", client(3))
    await until("both asked", lambda: a.worker.asked and b.worker.asked)
    await asyncio.sleep(0.2)
    assert not wc.future.done() and m.slots[0].shares == [a, b]
    assert a.keep_gpu == "the program shares device memory through CUDA IPC"
    assert b.keep_gpu is None and b.not_now == "a call is being served"


async def test_a_share_in_the_operators_mps_server_keeps_its_place(mgr: Any, tmp_path: Any) -> None:  # noqa: F811
    pipes = tmp_path / "mps"
    pipes.mkdir()
    m = await shared(mgr, share_mps=str(pipes))
    _, a = await lease_on(m, 1, req=share(8))
    assert a.keep_gpu == MPS_SHARE_KEEPS_GPU


async def test_a_whole_gpu_waiter_has_the_idle_shares_of_the_gpu_it_claimed_asked_at_once(mgr: Any) -> None:  # noqa: F811
    """Issue 32, item 5: the shares of a shared GPU claimed by a whole-GPU waiter are asked as
    soon as they have idled DRAIN_IDLE_S, not idle_detach_after (30 s here); a busy one is asked
    again soon; once the last has left, the GPU is scrubbed whole and the waiter's."""
    m = await shared(mgr, idle_detach_after=30.0)
    slot = m.slots[0]
    _, a = await lease_on(m, 1, req=share(8))
    _, b = await lease_on(m, 2, req=share(8))
    for le in (a, b):
        le.worker.active_at = time.monotonic()  # active just now: no idle-timeout ask for 29 s
    asks_a, asks_b = asked_with(a.worker), asked_with(b.worker)
    b.worker.idle_answer = gp.WorkerDetachNo(session_id=0, lasting=0, idle_ms=0,
                                             why="a call is being served")
    m.cleaner.cleaned.clear()
    whole = m.enqueue(Requirements(), "bob", client(3))
    await settle()
    assert slot.kept_for == whole.ticket
    await until("a detached", lambda: a.state == DETACHED, timeout=5)
    assert asks_a == [int(DRAIN_IDLE_S * 1000)] and asks_b and not whole.future.done()
    b.worker.idle_answer = gp.WorkerDetachOk(session_id=0, idle_ms=600, mem_used=GIB)
    assert await asyncio.wait_for(whole.future, 5) is slot  # b asked again, well before 15 s
    assert len(asks_b) >= 2 and b.state == DETACHED
    assert m.cleaner.cleaned == [0]  # scrubbed whole before the whole-GPU lease
    assert slot.shares == [] and slot.reserved is whole
    # Both come back as shares once the GPU is free of the whole lease (no room meanwhile).
    a.worker.wants_gpu.set()
    await asyncio.sleep(0.2)
    assert a.state != ATTACHED
    lease = await m.begin(whole, slot, b"hello", 1, -1)
    lease.worker.finish("client exit")
    await until("a back", lambda: a.state == ATTACHED and a.slot is slot, timeout=5)


async def test_a_share_does_not_detach_for_a_waiter_that_cannot_fit_in_its_place(mgr: Any) -> None:  # noqa: F811
    """Review finding (issue 32, item 5): on a 16 GiB GPU holding A (4 GiB, idle) and B (12 GiB,
    busy), C asking 8 GiB never fits beside B; A used to detach for it all the same, and then
    waited behind C with its own place free."""
    m = await shared(mgr)
    slot = m.slots[0]
    _, a = await lease_on(m, 1, req=share(4))
    _, b = await lease_on(m, 2, req=share(12))
    b.keep_gpu = "test: busy"
    wc = m.enqueue(share(8), "carol", client(3))
    await settle()
    await asyncio.sleep(0.6)  # a dozen idle timeouts
    assert a.state == ATTACHED and slot.shares == [a, b] and not wc.future.done()
    assert m.detacher.checkpointer.calls == []
    assert m.detacher._why_not_now(a, slot, 0) == (
        "nobody waits who may take its place on its GPU and fits there")


async def test_a_detached_share_comes_back_to_room_the_head_of_the_line_cannot_use(mgr: Any) -> None:  # noqa: F811
    """Review finding (issue 32, item 5): a share that detached (detach_policy = always) comes
    back to its place on its GPU although an 8 GiB share, ahead of it in the queue, waits there
    for room it cannot have until B ends."""
    m = await shared(mgr, detach_policy="always")
    slot = m.slots[0]
    _, a = await lease_on(m, 1, req=share(4))
    _, b = await lease_on(m, 2, req=share(12))
    b.keep_gpu = "test: busy"
    await until("a detached", lambda: a.state == DETACHED)
    wc = m.enqueue(share(8), "carol", client(3))
    await settle()
    assert not wc.future.done()
    a.worker.wants_gpu.set()  # its client calls again
    await until("a attached", lambda: ("attach", 0, a.worker.pid, ())
                in m.detacher.checkpointer.calls)
    await until("a attached", lambda: a.state == ATTACHED)
    assert set(slot.shares) == {a, b} and not wc.future.done()


def test_a_returning_share_tries_the_gpu_it_left_first() -> None:
    settings = ShareSettings(share=2)
    rooms = [GpuRoom(index=i, memory_total=16 * GIB, free=True) for i in range(2)]
    out = plan([Request(id=1, memory=8 * GIB), Request(id=2, memory=8 * GIB, home=1)], rooms,
               settings)
    assert [(p.request, p.gpu) for p in out.placements] == [(1, 0), (2, 1)]
    full = [GpuRoom(index=0, memory_total=16 * GIB, free=False, shares={7: 8 * GIB}),
            GpuRoom(index=1, memory_total=16 * GIB, free=False, shares={8: 12 * GIB})]
    out = plan([Request(id=3, memory=8 * GIB, home=1)], full, settings)
    assert [(p.request, p.gpu) for p in out.placements] == [(3, 0)]  # no room at home
