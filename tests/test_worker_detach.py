"""The worker's side of idle detach (worker/detach.c), through its control channel: when it says
idle and when not (a call being served, a copy whose data is still coming, a client that spoke
too recently), parking (no client frame is read), asking for a GPU on the next frame, serving it
once attached, and a client that goes while parked. gpupoold's side is tests/test_detach.py; the
whole path with checkpoints is tests/test_e2e_detach.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path

import gpupool_protocol as gp
import pytest
from test_worker_control import (  # noqa: F401
    Client,
    built,
    exited,
    gpu,
    start_session,
    supervisor,
    worker_output,
)

from gpupoold.gpu.inventory import Gpu
from gpupoold.workers.state_dir import WorkerDir
from gpupoold.workers.supervisor import WorkerSupervisor

pytestmark = pytest.mark.san


async def session(supervisor: WorkerSupervisor, gpu: Gpu) -> tuple[object, Client]:  # noqa: F811
    w = await supervisor.spawn(gpu)
    c = Client()
    assert await start_session(w, 1, c)
    c.hello_reply()
    return w, c


async def call(c: Client, msg: object, bulk: bytes = b"") -> tuple[object, bytes]:
    return await asyncio.to_thread(c.call, msg, bulk)


async def test_idle_parked_woken_by_the_next_frame_and_served_once_attached(
        supervisor: WorkerSupervisor, gpu: Gpu) -> None:  # noqa: F811
    w, c = await session(supervisor, gpu)
    r, _ = await call(c, gp.MemAlloc(size=1 << 20, stream=0, flags=0))
    too_soon = await w.ask_detach(60_000)
    assert isinstance(too_soon, gp.WorkerDetachNo) and too_soon.lasting == 0
    assert "the client sent a frame" in too_soon.why and too_soon.idle_ms < 60_000
    await asyncio.sleep(0.3)
    ok = await w.ask_detach(200)
    assert isinstance(ok, gp.WorkerDetachOk), ok
    assert ok.idle_ms >= 200 and ok.mem_used == 2 << 20  # rounded to the 2 MiB granularity
    # Parked: a frame is not answered; the worker asks for a GPU instead.
    sent = time.monotonic()
    reply = asyncio.ensure_future(call(c, gp.MemGetInfo()))
    await asyncio.wait_for(w.wants_gpu.wait(), 10)
    await asyncio.sleep(0.3)
    assert not reply.done()
    await w.tell_attached(gpu, False)
    r, _ = await asyncio.wait_for(reply, 10)
    assert r.result == 0 and time.monotonic() - sent >= 0.3  # type: ignore[attr-defined]
    # Serving as before; asked again later, idle again.
    await asyncio.sleep(0.25)
    assert isinstance(await w.ask_detach(200), gp.WorkerDetachOk)
    await w.tell_attached(gpu, False)  # let go without a frame: it serves again
    r, _ = await call(c, gp.CtxSynchronize())
    assert r.result == 0  # type: ignore[attr-defined]
    c.close()
    ex = await exited(w)
    assert ex.reason == "client lost", ex


async def test_a_copy_whose_data_is_still_coming_is_never_idle(
        supervisor: WorkerSupervisor, gpu: Gpu) -> None:  # noqa: F811
    w, c = await session(supervisor, gpu)
    r, _ = await call(c, gp.MemAlloc(size=4 << 20, stream=0, flags=0))
    ptr = r.dptr  # type: ignore[attr-defined]
    data = os.urandom(4 << 20)
    # Header and half the data, then the client stalls for longer than the idle time asked.
    c.sock.sendall(gp.encode_frame(gp.MemcpyHtod(dst=ptr, stream=0, is_async=0,
                                                 data=len(data)), 0) + data[: 2 << 20])
    await asyncio.sleep(0.5)
    answer = await w.ask_detach(100)
    assert isinstance(answer, gp.WorkerDetachNo) and answer.why == "a call is being served"
    c.sock.sendall(data[2 << 20:])
    r, back = await call(c, gp.MemcpyDtoh(src=ptr, size=len(data), stream=0, is_async=0))
    assert back == data
    c.close()
    await exited(w)


async def test_a_client_that_goes_while_parked_ends_the_session_at_once(
        supervisor: WorkerSupervisor, gpu: Gpu) -> None:  # noqa: F811
    w, c = await session(supervisor, gpu)
    await call(c, gp.MemAlloc(size=1 << 20, stream=0, flags=0))
    await asyncio.sleep(0.2)
    assert isinstance(await w.ask_detach(100), gp.WorkerDetachOk)
    await w.tell_detached()
    c.close()
    t0 = time.monotonic()
    ex = await exited(w, 10)
    assert ex.reason == "client lost" and "while its lease was detached" in ex.detail, ex
    assert time.monotonic() - t0 < 3


async def test_the_server_ends_a_parked_session(supervisor: WorkerSupervisor, gpu: Gpu) -> None:  # noqa: F811
    w, c = await session(supervisor, gpu)
    await asyncio.sleep(0.2)
    assert isinstance(await w.ask_detach(100), gp.WorkerDetachOk)
    await w.end("the operator ended this lease", gp.GP_EREFUSED)
    await asyncio.to_thread(c.wait_closed)
    assert any("operator ended" in n.text for n in c.notices), c.notices
    c.close()
    ex = await exited(w, 10)
    assert ex.reason == "server ended", ex


async def test_a_parked_session_ends_when_gpupoold_goes(tmp_path: Path, gpu: Gpu) -> None:  # noqa: F811
    sup = WorkerSupervisor(supervisor_worker(), tmp_path / "cache")
    w, c = await session(sup, gpu)
    await asyncio.sleep(0.2)
    assert isinstance(await w.ask_detach(100), gp.WorkerDetachOk)
    pid = w.pid
    w.detach()  # the daemon goes: the control socket closes
    await asyncio.sleep(0)
    await asyncio.to_thread(c.wait_closed)
    assert any("stopped while this process idled" in n.text for n in c.notices), c.notices
    c.close()
    # It exits by itself (not waiting to be adopted): reaped here, since the supervisor let go.
    status = None
    for _ in range(100):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        await asyncio.sleep(0.05)
    assert status is not None and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    await sup.stop_all(grace=5)


async def test_a_detached_session_outlives_gpupoold_and_tells_the_next_one(
        tmp_path: Path, gpu: Gpu) -> None:  # noqa: F811
    """Adoptable and detached, the session goes on orphaned (worker/adopt.c); its client's call
    meanwhile is held; the next gpupoold hears worker_detach_ok before worker_adopted (the lease
    has no GPU), then worker_wants_gpu, and the call is served once it is attached again."""
    workers = WorkerDir(tmp_path)
    workers.prepare(True)
    first = WorkerSupervisor(supervisor_worker(), tmp_path / "cache", workers_dir=workers,
                             orphan_grace=30)
    w, c = await session(first, gpu)
    await call(c, gp.MemAlloc(size=1 << 20, stream=0, flags=0))
    await asyncio.sleep(0.2)
    ok = await w.ask_detach(100)
    assert isinstance(ok, gp.WorkerDetachOk), ok
    await w.tell_detached()
    pid = w.pid
    w.detach()  # gpupoold stops and leaves the detached session to the next one
    await asyncio.sleep(0.3)
    reply = asyncio.ensure_future(call(c, gp.MemGetInfo()))  # no gpupoold at all now
    await asyncio.sleep(0.5)
    assert not reply.done() and os.waitpid(pid, os.WNOHANG) == (0, 0)
    second = WorkerSupervisor(supervisor_worker(), tmp_path / "cache", workers_dir=workers,
                              orphan_grace=30)
    sock, peer = await second.connect_adoption(workers.socket(1))
    assert peer == pid
    adopted = await second.adopt(gpu, sock, pid)
    assert adopted.session_id == 1 and adopted.adopted_detached == ok.mem_used
    await asyncio.wait_for(adopted.wants_gpu.wait(), 10)
    assert not reply.done()
    await adopted.tell_attached(gpu, False)
    r, _ = await asyncio.wait_for(reply, 10)
    assert r.result == 0  # type: ignore[attr-defined]
    c.close()
    ex = await exited(adopted, 10)
    assert ex.reason == "client lost", ex
    await second.stop_all(grace=5)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def supervisor_worker() -> Path:
    from test_worker_control import WORKER
    return WORKER
