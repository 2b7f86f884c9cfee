"""The worker's side of the virtual memory management messages (protocol ids 70-76), driven
directly with the generated protocol on the simulated device: reservations carved from the VA
window, physical memory under client ids, maps, access, unmaps, and the deferred errors of
requests the client should have refused.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import worker_client as wc
from conftest import SANITIZER_MARKS, require
from worker_client import WorkerSession, gp, handle

pytestmark = pytest.mark.san

CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
H_MEMHANDLE = 18


@pytest.fixture(autouse=True)
def built(native_build: Path) -> None:
    assert native_build == wc.BUILD, (native_build, wc.BUILD)
    require(wc.WORKER.exists(), "gpupool-worker is not built")
    require(wc.SIM.exists(), "the simulated device (libgpupool-sim.so) is not built")


@pytest.fixture
def session(tmp_path: Path):
    s = WorkerSession(tmp_path / "cache")
    assert s.hello.result == 0, s.hello.message
    yield s
    if s.proc.poll() is None:
        assert s.close() == 0, s.stderr_text()
    text = s.stderr_text()
    for bad in (*SANITIZER_MARKS, "Segmentation", "Aborted"):
        assert bad not in text, text


def reserve(s: WorkerSession, size: int, alignment: int = 0, addr: int = 0) -> gp.VmmReserveReply:
    reply, _ = s.call(gp.VmmReserve(size=size, alignment=alignment, addr=addr))
    return reply


def create(s: WorkerSession, n: int, size: int) -> int:
    reply, _ = s.call(gp.VmmCreate(handle=handle(H_MEMHANDLE, n), size=size, handle_types=0,
                                   alloc_flags=0))
    return reply.result


def test_map_two_handles_and_copy_across(session: WorkerSession) -> None:
    g = session.hello.granularity
    r = reserve(session, 4 * g)
    assert r.result == 0 and r.ptr % g == 0
    assert wc.DEFAULT_VA_BASE <= r.ptr < wc.DEFAULT_VA_BASE + wc.DEFAULT_VA_SIZE
    a = session.alloc(g)  # cuMemAlloc memory never lands inside a reservation
    assert a.result == 0 and not r.ptr <= a.dptr < r.ptr + 4 * g
    assert create(session, 1, g) == 0 and create(session, 2, 2 * g) == 0
    session.post(gp.VmmMap(ptr=r.ptr, size=g, offset=0, handle=handle(H_MEMHANDLE, 1)))
    session.post(gp.VmmMap(ptr=r.ptr + g, size=2 * g, offset=0, handle=handle(H_MEMHANDLE, 2)))
    session.post(gp.VmmSetAccess(ptr=r.ptr, size=3 * g, flags=3))
    data = random.Random(7).randbytes(1 << 20)
    at = r.ptr + g - len(data) // 2
    session.htod(at, data)
    rc, back = session.dtoh(at, len(data))
    assert rc == 0 and back == data
    # Released while mapped: the memory stays until the unmap.
    session.post(gp.VmmRelease(handle=handle(H_MEMHANDLE, 2)))
    rc, back = session.dtoh(at, len(data))
    assert rc == 0 and back == data
    session.post(gp.VmmUnmap(ptr=r.ptr, size=g))
    session.post(gp.VmmUnmap(ptr=r.ptr + g, size=2 * g))
    session.post(gp.VmmRelease(handle=handle(H_MEMHANDLE, 1)))
    session.post(gp.VmmAddressFree(ptr=r.ptr, size=4 * g))
    assert session.sync() == 0, [n.text for n in session.notices]
    # The range goes back to the window: the same reservation comes back.
    assert reserve(session, 4 * g).ptr == r.ptr


def test_reserve_hint_alignment_and_errors(session: WorkerSession) -> None:
    g = session.hello.granularity
    hint = wc.DEFAULT_VA_BASE + (512 << 30)
    r = reserve(session, 2 * g, addr=hint)
    assert r.result == 0 and r.ptr == hint
    taken = reserve(session, 2 * g, addr=hint)  # taken: placed elsewhere
    assert taken.result == 0 and taken.ptr != hint
    big_align = 1 << 30
    al = reserve(session, g, alignment=big_align)
    assert al.result == 0 and al.ptr % big_align == 0
    assert reserve(session, g + 1).result == CUDA_ERROR_INVALID_VALUE
    assert reserve(session, g, alignment=3 * g).result == CUDA_ERROR_INVALID_VALUE
    assert reserve(session, 1 << 50).result == CUDA_ERROR_OUT_OF_MEMORY  # more than the window


def test_create_out_of_memory_and_bad_ids(session: WorkerSession) -> None:
    g = session.hello.granularity
    assert create(session, 1, (1 << 40) // g * g) == CUDA_ERROR_OUT_OF_MEMORY
    assert create(session, 2, g) == 0
    assert create(session, 2, g) == CUDA_ERROR_INVALID_VALUE  # the id is in use


@pytest.mark.parametrize("case", ["outside", "unknown_handle", "past_handle", "overlap",
                                  "unmap_unmapped", "free_unknown", "release_unknown"])
def test_refused_calls_are_deferred_errors(session: WorkerSession, case: str) -> None:
    g = session.hello.granularity
    r = reserve(session, 2 * g)
    assert create(session, 1, g) == 0
    h = handle(H_MEMHANDLE, 1)
    msg: object = {
        "outside": gp.VmmMap(ptr=r.ptr + g, size=2 * g, offset=0, handle=h),
        "unknown_handle": gp.VmmMap(ptr=r.ptr, size=g, offset=0, handle=handle(H_MEMHANDLE, 9)),
        "past_handle": gp.VmmMap(ptr=r.ptr, size=g, offset=g, handle=h),
        "overlap": gp.VmmMap(ptr=r.ptr, size=g, offset=0, handle=h),
        "unmap_unmapped": gp.VmmUnmap(ptr=r.ptr + g, size=g),
        "free_unknown": gp.VmmAddressFree(ptr=r.ptr + g, size=g),
        "release_unknown": gp.VmmRelease(handle=handle(H_MEMHANDLE, 5)),
    }[case]
    if case == "overlap":
        session.post(gp.VmmMap(ptr=r.ptr, size=g, offset=0, handle=h))
    session.post(msg)
    assert session.sync() == CUDA_ERROR_INVALID_VALUE
    assert session.notices[-1].op == type(msg).OP
    assert session.sync() == 0  # not sticky


def test_session_end_with_live_mappings(session: WorkerSession) -> None:
    g = session.hello.granularity
    r = reserve(session, 2 * g)
    assert create(session, 1, 2 * g) == 0
    session.post(gp.VmmMap(ptr=r.ptr, size=2 * g, offset=0, handle=handle(H_MEMHANDLE, 1)))
    session.post(gp.VmmSetAccess(ptr=r.ptr, size=2 * g, flags=3))
    session.htod(r.ptr + 5, b"left behind")
    assert session.sync() == 0
    assert session.close() == 0, session.stderr_text()
    assert "unmapping" not in session.stderr_text() and "lost" not in session.stderr_text()
