"""The lease manager's shares of shared GPUs (gpupoold/pool/share_leases.py, issue 32), with fake
workers (tests/test_leases.py's): the worker's quota and environment, the whole scrub after the
last share only, a dead share worker closing its GPU, a share that can never fit refused."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

from test_leases import GIB, client, lease_on, make_gpu, mgr, settle  # noqa: F401 (fixture)

from gpupoold.pool.privacy import private_view
from gpupoold.pool.requirements import Requirements
from gpupoold.pool.slots import FREE, LEASED
from gpupoold.pool.views import PoolViews
from gpupoold.store.records import TokenRecord
from gpupoold.workers.supervisor import WorkerSupervisor


def share(gib: int) -> Requirements:
    return Requirements(memory=gib * GIB)


async def test_shares_run_side_by_side_with_their_quota_and_environment(mgr: Any) -> None:  # noqa: F811
    m = await mgr(gpus=[make_gpu(0, memory=32 * GIB)], share=4)
    leases = [(await lease_on(m, i, req=share(8)))[1] for i in range(1, 5)]
    slot = m.slots[0]
    assert slot.state == LEASED and slot.shares == leases and slot.lease is None
    assert len({le.worker.pid for le in leases}) == 4  # a worker each
    assert [le.worker.memory_quota for le in leases] == [8 * GIB] * 4
    env = leases[1].worker.gpu.env
    assert env["GPUPOOL_SIM_SHARED_DIR"] == env["GPUPOOL_WORKER_PACE_DIR"]
    assert env["GPUPOOL_WORKER_PACE_GPU"] == slot.gpu.uuid and env["GPUPOOL_SIM_SHARED_DIR"] in \
        leases[1].worker.gpu.writable
    fifth = m.enqueue(share(8), "alice", client(5))
    await settle()
    assert not fifth.future.done()  # full: it waits
    m.cleaner.cleaned.clear()
    leases[0].worker.finish("client exit")
    await asyncio.wait_for(fifth.future, 1)  # the first share's place, no scrub between
    assert m.cleaner.cleaned == []
    lease5 = await m.begin(fifth, slot, b"hello", 1, -1)
    for le in [*leases[1:], lease5]:
        le.worker.finish("client exit")
    await settle()
    assert m.cleaner.cleaned == [0] and slot.state == FREE  # scrubbed whole once, at the end


async def test_a_share_runs_with_its_tokens_weight(mgr: Any) -> None:  # noqa: F811
    """Issue 32, item 4: the worker of a share gets its token's weight (GPUPOOL_WORKER_SHARE_WEIGHT,
    read by worker/pacing.c when the worker starts: a weight other than 1 gets a worker of its
    own, not the pre-started one); a token without a record (auth = none) gets 1."""
    m = await mgr(gpus=[make_gpu(0, memory=32 * GIB)], share=4)
    m.store.tokens["heavy"] = TokenRecord("0" * 12, "heavy", "user", 0.0, None, None, None, "t",
                                          weight=3)
    prestarted = m.slots[0].idle_worker
    _, heavy = await lease_on(m, 1, token="heavy", req=share(8))
    _, light = await lease_on(m, 2, token="alice", req=share(8))
    assert heavy.worker.gpu.env["GPUPOOL_WORKER_SHARE_WEIGHT"] == "3"
    assert light.worker.gpu.env["GPUPOOL_WORKER_SHARE_WEIGHT"] == "1"
    assert heavy.worker is not prestarted and light.worker is prestarted


async def test_a_dead_share_worker_closes_the_gpu_until_its_whole_scrub(mgr: Any) -> None:  # noqa: F811
    m = await mgr(gpus=[make_gpu(0, memory=32 * GIB)], share=4)
    _, first = await lease_on(m, 1, req=share(8))
    _, second = await lease_on(m, 2, req=share(8))
    m.cleaner.cleaned.clear()
    first.worker.finish("worker crashed", "killed by signal 9")
    await settle()
    slot = m.slots[0]
    assert slot.share_closed and m.cleaner.cleaned == []
    third = m.enqueue(share(8), "alice", client(3))
    await settle()
    assert not third.future.done()  # room for it, but nothing says the dead share's memory is zero
    second.worker.finish("client exit")
    await asyncio.wait_for(third.future, 1)  # after the whole scrub
    assert m.cleaner.cleaned == [0] and not slot.share_closed


async def test_a_share_larger_than_every_shared_gpu_is_refused_at_its_hello(mgr: Any) -> None:  # noqa: F811
    m = await mgr(gpus=[make_gpu(0, memory=32 * GIB)], share=4)
    why = m.feasible(share(40))
    assert why is not None and "GPUPOOL_MEMORY" in why and "ask for less" in why
    assert m.feasible(share(32)) is None
    assert (await mgr(gpus=[make_gpu(0, memory=32 * GIB)])).feasible(share(40)) is None  # no sharing: capped


async def test_the_gpu_view_lists_its_shares_as_each_viewer_may_see_them(mgr: Any) -> None:  # noqa: F811
    m = await mgr(gpus=[make_gpu(0, memory=32 * GIB), make_gpu(1)], share=4, share_gpus=[0])
    _, first = await lease_on(m, 1, req=share(8))
    first.client = replace(first.client, program="train.py --api-key=s3cret")
    views = PoolViews(m)
    gpu0, gpu1 = views.gpu_views()
    assert gpu1["shares"] is None and gpu0["lease"] is None
    assert gpu0["shares"]["max"] == 4 and not gpu0["shares"]["closed"]
    (entry,) = gpu0["shares"]["leases"]
    assert (entry["id"], entry["token"], entry["memory_quota"]) == (first.id, "alice", 8 * GIB)
    assert views.lease(first)["memory_quota"] == 8 * GIB
    seen = private_view(gpu0, "bob", "user")["shares"]["leases"][0]["client"]["program"]
    assert seen == "train.py"  # another tenant sees the program's name only
    own = private_view(gpu0, "alice", "user")["shares"]["leases"][0]["client"]["program"]
    assert own == "train.py --api-key=s3cret"


async def test_shares_join_the_operators_mps_server_only_with_share_mps(mgr: Any, tmp_path: Path) -> None:  # noqa: F811
    """Issue 32, item 4 (share_mps): the workers of a shared GPU get the MPS pipe directory in
    their environment and their sandbox (with /dev/shm, where the driver's MPS client keeps its
    shared memory); an unshared GPU's, and every worker without share_mps, get neither."""
    pipes = tmp_path / "mps"
    pipes.mkdir()
    m = await mgr(gpus=[make_gpu(0, memory=32 * GIB), make_gpu(1)], share=4, share_gpus=[0],
                  share_mps=str(pipes))
    _, first = await lease_on(m, 1, req=share(8))
    _, whole = await lease_on(m, 2)
    assert first.slot.gpu.index == 0 and whole.slot.gpu.index == 1
    gpu = first.worker.gpu
    assert gpu.env["CUDA_MPS_PIPE_DIRECTORY"] == str(pipes)
    assert str(pipes) in gpu.writable and "/dev/shm" in gpu.writable
    argv = WorkerSupervisor(tmp_path / "w", tmp_path / "cache").argv(gpu, 3)
    rw = [argv[i + 1] for i, a in enumerate(argv) if a == "--sandbox-rw"]
    assert str(pipes) in rw and "/dev/shm" in rw
    assert "CUDA_MPS_PIPE_DIRECTORY" not in whole.worker.gpu.env
    assert str(pipes) not in whole.worker.gpu.writable
    plain = await mgr(gpus=[make_gpu(0, memory=32 * GIB)], share=4)
    _, lease = await lease_on(plain, 1, req=share(8))
    assert "CUDA_MPS_PIPE_DIRECTORY" not in lease.worker.gpu.env
    assert "/dev/shm" not in lease.worker.gpu.writable
