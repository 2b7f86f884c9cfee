"""Idle detach in the lease manager (gpupoold/pool/detach.py) with fake workers, checkpoints,
store and cleaner: when a lease is asked, what makes it keep its GPU, the hand-over to the
queue, the returning lease's place in the queue, moves, limits and failures. The end-to-end
tests are tests/test_e2e_detach.py."""

from __future__ import annotations

import asyncio
from typing import Any

import gpupool_protocol as gp
from test_leases import GIB, client, lease_on, make_gpu, mgr, settle  # noqa: F401

from gpupoold.gpu.checkpoint import CheckpointResult
from gpupoold.gpu.inventory import Gpu
from gpupoold.pool.detach import in_program_order
from gpupoold.pool.leases import FREE
from gpupoold.pool.requirements import Requirements
from gpupoold.pool.slots import ATTACHED, DETACHED, Slot


class FakeCheckpointer:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.detach_result = CheckpointResult(True, 0.01)
        self.attach_result = CheckpointResult(True, 0.01)

    async def detach(self, gpu: Gpu, pid: int) -> CheckpointResult:
        self.calls.append(("detach", gpu.index, pid))
        return self.detach_result

    async def attach(self, gpu: Gpu, pid: int, moves: tuple[tuple[str, str], ...]) -> CheckpointResult:
        self.calls.append(("attach", gpu.index, pid, moves))
        return self.attach_result


async def until(what: str, cond: Any, timeout: float = 3.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def detaching(mgr: Any, gpus: int = 1, **settings: Any) -> Any:  # noqa: F811
    m = await mgr(gpus, idle_detach_after=0.05, **settings)
    m.detacher.checkpointer = FakeCheckpointer()
    return m


async def test_an_idle_lease_keeps_its_gpu_until_someone_waits_then_hands_it_over(mgr: Any) -> None:  # noqa: F811
    m = await detaching(mgr)
    _, lease = await lease_on(m, 1)
    await asyncio.sleep(0.3)
    assert lease.worker.asked == 0 and lease.state == ATTACHED  # nobody waits (when-queued)
    w = m.enqueue(Requirements(), "bob", client(2))
    slot = await asyncio.wait_for(w.future, 3)
    assert slot is m.slots[0] and lease.state == DETACHED and lease.slot is None
    assert lease.worker.told == [("detached",)] and lease.detaches == 1
    assert m.detacher.checkpointer.calls == [("detach", 0, lease.worker.pid)]
    assert m.cleaner.cleaned == [0, 0]  # the start-up scrub, then the one between tenants
    assert m.store.scrubbed[lease.id][0] is True  # its last use of GPU 0, scrubbed
    assert lease.saved_bytes == GIB and m.detacher.held_bytes() == GIB
    assert m.store.events[lease.id][0][0] == "detached"


async def test_policy_always_detaches_with_nobody_waiting(mgr: Any) -> None:  # noqa: F811
    m = await detaching(mgr, detach_policy="always")
    _, lease = await lease_on(m, 1)
    await until("detached", lambda: lease.state == DETACHED)
    await until("the GPU free again", lambda: m.slots[0].state == FREE)


async def test_the_returning_lease_queues_in_arrival_order_and_gets_its_gpu_back(mgr: Any) -> None:  # noqa: F811
    m = await detaching(mgr)
    _, lease = await lease_on(m, 1)
    w2 = m.enqueue(Requirements(), "bob", client(2))
    slot = await asyncio.wait_for(w2.future, 3)
    second = await m.begin(w2, slot, b"hello", 1, -1)
    second.keep_gpu = "test: stays"
    w3 = m.enqueue(Requirements(), "carol", client(3))  # waiting since before A calls again
    lease.worker.wants_gpu.set()
    await until("A queued", lambda: len(m.queue) == 2)
    assert [x.returning for x in m.queue] == [None, lease.id]
    second.worker.finish("client exit")
    third = await m.begin(w3, await asyncio.wait_for(w3.future, 3), b"hello", 1, -1)
    assert lease.state != ATTACHED and third.slot is m.slots[0]  # carol asked first
    third.worker.finish("client exit")
    await until("A attached", lambda: lease.state == ATTACHED)
    assert lease.slot is m.slots[0] and m.slots[0].lease is lease and m.slots[0].task is lease.watcher
    assert lease.worker.told[-1] == ("attached", m.slots[0].gpu.uuid, "False")
    assert m.detacher.checkpointer.calls[-1] == ("attach", 0, lease.worker.pid, ())
    assert lease.saved_bytes == 0 and lease.detached_s > 0
    assert [e[0] for e in m.store.events[lease.id]] == ["detached", "attached"]


async def test_a_lease_whose_gpu_is_taken_comes_back_on_another_of_the_same_model(mgr: Any) -> None:  # noqa: F811
    m = await detaching(mgr, 2, detach_policy="always")
    _, lease = await lease_on(m, 1)
    await until("detached", lambda: lease.state == DETACHED)
    await until("GPU 0 free", lambda: m.slots[0].state == FREE)
    _, other = await lease_on(m, 2)
    other.keep_gpu = "test: stays"
    assert other.slot is m.slots[0]
    lease.worker.wants_gpu.set()
    await until("A attached", lambda: lease.state == ATTACHED)
    assert lease.slot is m.slots[1]
    moves = ((m.slots[0].gpu.uuid, m.slots[1].gpu.uuid),)
    assert m.detacher.checkpointer.calls[-1] == ("attach", 1, lease.worker.pid, moves)
    assert lease.worker.told[-1] == ("attached", m.slots[1].gpu.uuid, "True")


async def test_a_gpu_of_another_model_is_never_a_target(mgr: Any) -> None:  # noqa: F811
    gpus = [make_gpu(0), make_gpu(1, name="NVIDIA A100 (gpupool simulated)", memory=40 * GIB)]
    m = await mgr(gpus=gpus, idle_detach_after=0.05, detach_policy="always")
    m.detacher.checkpointer = FakeCheckpointer()
    _, lease = await lease_on(m, 1)  # any GPU: it got GPU 0, an H100
    assert lease.slot is m.slots[0]
    await until("detached", lambda: lease.state == DETACHED)
    await until("GPU 0 free", lambda: m.slots[0].state == FREE)
    _, other = await lease_on(m, 2, req=Requirements(gpu="0"))
    other.keep_gpu = "test: stays"
    lease.worker.wants_gpu.set()
    await asyncio.sleep(0.3)
    assert lease.slot is None and m.slots[1].state == FREE  # waits for GPU 0
    other.worker.finish("client exit")
    await until("A attached on GPU 0", lambda: lease.slot is m.slots[0])


async def test_a_lease_that_would_not_fit_the_memory_limit_keeps_its_gpu_and_says_so(mgr: Any) -> None:  # noqa: F811
    m = await detaching(mgr, detach_policy="always", detach_memory_limit_gib=0.5)
    _, lease = await lease_on(m, 1)  # the fake says 1 GiB
    await until("asked", lambda: lease.worker.asked >= 1)
    await until("answered", lambda: lease.not_now != "")
    assert lease.state == ATTACHED and lease.slot is m.slots[0]
    assert "would not fit in detach_memory_limit_gib" in lease.not_now
    assert lease.worker.told == [("attached", m.slots[0].gpu.uuid, "False")]  # unparked
    assert m.detacher.checkpointer.calls == []


async def test_the_worker_saying_never_and_a_driver_without_checkpoints_keep_the_gpu(mgr: Any) -> None:  # noqa: F811
    m = await detaching(mgr, 2, detach_policy="always")
    _, lease = await lease_on(m, 1)
    lease.worker.idle_answer = gp.WorkerDetachNo(session_id=0, lasting=1, idle_ms=0, why="IPC handle exported")
    await until("refused", lambda: lease.keep_gpu is not None)
    assert lease.keep_gpu == "IPC handle exported" and lease.slot is m.slots[0]
    m.detacher.checkpointer.detach_result = CheckpointResult(
        False, 0.0, error="the driver x.so lacks cuCheckpointProcessLock", unsupported=True)
    _, other = await lease_on(m, 2)
    await until("checkpoint refused", lambda: other.keep_gpu is not None)
    assert "lacks cuCheckpointProcessLock" in other.keep_gpu and other.slot is m.slots[1]
    assert other.worker.told[-1][0] == "attached"
    # Every lease on that driver keeps its GPU from now on, without asking.
    other.worker.finish("client exit")
    await until("GPU 1 free", lambda: m.slots[1].state == FREE)
    _, third = await lease_on(m, 3)
    await until("marked", lambda: third.keep_gpu is not None)
    assert third.worker.asked == 0


async def test_a_busy_answer_is_tried_again_later(mgr: Any) -> None:  # noqa: F811
    m = await detaching(mgr, detach_policy="always")
    _, lease = await lease_on(m, 1)
    lease.worker.idle_answer = gp.WorkerDetachNo(session_id=0, lasting=0, idle_ms=0, why="a call is being served")
    await until("asked", lambda: lease.worker.asked >= 1)
    await until("answered", lambda: lease.not_now == "a call is being served")
    assert lease.keep_gpu is None
    lease.worker.idle_answer = gp.WorkerDetachOk(session_id=0, idle_ms=100, mem_used=0)
    await until("detached", lambda: lease.state == DETACHED)


async def test_a_detached_lease_whose_client_goes_ends_without_another_scrub(mgr: Any) -> None:  # noqa: F811
    m = await detaching(mgr, detach_policy="always")
    _, lease = await lease_on(m, 1)
    await until("detached", lambda: lease.state == DETACHED)
    await until("GPU free", lambda: m.slots[0].state == FREE)
    cleaned = list(m.cleaner.cleaned)
    lease.worker.finish("client lost", "the client closed the connection while detached")
    await until("ended", lambda: lease.id in m.store.ended)
    await settle()
    assert m.store.ended[lease.id][0] == "client lost" and m.cleaner.cleaned == cleaned
    assert m.slots[0].state == FREE and m.detacher.held_bytes() == 0


async def test_a_failed_restore_ends_the_lease_and_scrubs_the_gpu(mgr: Any) -> None:  # noqa: F811
    m = await detaching(mgr, detach_policy="always")
    _, lease = await lease_on(m, 1)
    await until("detached", lambda: lease.state == DETACHED)
    await until("GPU free", lambda: m.slots[0].state == FREE)
    m.detacher.checkpointer.attach_result = CheckpointResult(False, 0.1, error="restore failed")
    lease.worker.wants_gpu.set()
    await until("ended", lambda: lease.id in m.store.ended)
    assert m.store.ended[lease.id][0] == "worker error"
    await until("GPU scrubbed and free", lambda: m.slots[0].state == FREE)
    assert m.cleaner.cleaned[-1] == 0


def test_the_dashboard_says_where_a_lease_is() -> None:
    from gpupoold.dashboard.formatting import detach_text

    assert detach_text({"state": "attached", "detaches": 0, "keep_gpu": None}) == "attached"
    assert detach_text({"state": "detached", "left_gpu": 1, "saved_bytes": 2 * GIB,
                        "detached_s": 75, "detaches": 1}) == \
        "detached (left GPU 1, 2.0 GiB saved, 1m 15s detached in all)"
    assert detach_text({"state": "attached", "detaches": 3, "detached_s": 9,
                        "keep_gpu": "the checkpoint failed: x"}) == \
        "attached (3x detached, 9s in all); keeps its GPU: the checkpoint failed: x"


async def test_a_lease_of_two_gpus_leaves_both_and_comes_back_on_two_others_every_gpu_paired(
        mgr: Any) -> None:  # noqa: F811
    m = await detaching(mgr, 4, detach_policy="always")
    w = m.enqueue(Requirements(gpus=2), "alice", client(1))
    lease = await m.begin(w, await asyncio.wait_for(w.future, 3), b"hello", 1, -1)
    assert lease.gpu_indexes() == [0, 1] and lease.keep_gpu is None
    await until("detached", lambda: lease.state == DETACHED)
    assert lease.slot is None and lease.other_slots == [] and lease.homes == [
        m.slots[0].gpu, m.slots[1].gpu]
    await until("GPUs 0 and 1 free", lambda: m.slots[0].state == FREE and m.slots[1].state == FREE)
    assert sorted(m.cleaner.cleaned[-2:]) == [0, 1]  # both scrubbed, as after a lease
    assert m.pool.held("alice") == 2  # the detached lease keeps its place for both
    w2 = m.enqueue(Requirements(gpus=2), "bob", client(2))
    other = await m.begin(w2, await asyncio.wait_for(w2.future, 3), b"hello", 1, -1)
    other.keep_gpu = "test: stays"
    assert other.gpu_indexes() == [0, 1]
    lease.worker.wants_gpu.set()
    await until("attached", lambda: lease.state == ATTACHED)
    assert lease.gpu_indexes() == [2, 3]
    assert all(s.lease is lease and s.task is lease.watcher for s in m.slots[2:])
    uuid = [s.gpu.uuid for s in m.slots]
    moves = ((uuid[0], uuid[2]), (uuid[1], uuid[3]))
    assert m.detacher.checkpointer.calls[-1] == ("attach", 2, lease.worker.pid, moves)
    assert lease.worker.told[-1] == ("attached", uuid[2], "True")
    assert m.store.events[lease.id][-1][0] == "attached"
    # The store's events name every GPU it left and came back on (program order), device 0's
    # first as `gpu`: a restart and the history follow all of them (issue 37, schema v15).
    assert [(e[0], e[1], e[4]) for e in m.store.events[lease.id]] == [
        ("detached", 0, [0, 1]), ("attached", 2, [2, 3])]


def test_a_returning_lease_of_several_keeps_the_gpus_it_got_back_in_place() -> None:
    gpus = [make_gpu(i) for i in range(4)]
    slots = [Slot(g) for g in gpus]
    # It left GPUs 0 and 1 and got 3 and 0 back (the queue's order): GPU 0 stays device 0.
    assert in_program_order(gpus[:2], [slots[3], slots[0]]) == [slots[0], slots[3]]
    assert in_program_order(gpus[:2], [slots[2], slots[3]]) == [slots[2], slots[3]]
    assert in_program_order(gpus[:1], [slots[1]]) == [slots[1]]
