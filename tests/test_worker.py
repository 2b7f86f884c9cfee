"""gpupool-worker against the simulated device, driven over a socketpair by tests/worker_client.py.

Builds the worker and the sim first (`make`, or `make SAN=1` when GPUPOOL_BUILD_DIR names the
sanitizer build). Under a sanitizer build every session also checks that the worker's stderr is
free of sanitizer reports.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
from pathlib import Path

import pytest
import worker_client as wc
from conftest import SANITIZER_MARKS, require
from worker_client import PRIMARY_CTX, WorkerSession, gp, handle

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_INVALID_CONTEXT = 201
CUDA_ERROR_INVALID_HANDLE = 400
CUDA_ERROR_NOT_FOUND = 500
CUDA_ERROR_ILLEGAL_ADDRESS = 700
CUDA_ERROR_NOT_SUPPORTED = 801

H_CTX, H_STREAM, H_EVENT, H_MODULE, H_LIBRARY, H_FUNC, H_KERNEL = 1, 2, 3, 4, 5, 6, 7

KERNEL_SOURCE = r"""
__device__ int gp_test_value = 42;

extern "C" __global__ void gp_test_axpy(float a, const float *x, float *y, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        y[i] = a * x[i] + y[i];
}
"""


# ---------------------------------------------------------------------------------- fixtures
pytestmark = pytest.mark.san  # scripts/test.sh runs these against the sanitizer build too


@pytest.fixture(autouse=True)
def built(native_build: Path) -> None:
    assert native_build == wc.BUILD, (native_build, wc.BUILD)
    require(wc.WORKER.exists(), "gpupool-worker is not built")
    require(wc.SIM.exists(), "the simulated device (libgpupool-sim.so) is not built")


def check_clean(s: WorkerSession) -> None:
    """No sanitizer report or crash in the worker's stderr."""
    text = s.stderr_text()
    for bad in (*SANITIZER_MARKS, "Segmentation", "Aborted"):
        assert bad not in text, text


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    return tmp_path / "cache"


@pytest.fixture
def session(cache_dir: Path):
    s = WorkerSession(cache_dir)
    assert s.hello.result == 0, s.hello.message
    yield s
    if s.proc.poll() is None:
        assert s.close() == 0, s.stderr_text()
    check_clean(s)


@pytest.fixture(scope="session")
def cubin(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    require(Path(nvcc).exists(), "nvcc is not installed (needed to build the test cubin)")
    d = tmp_path_factory.mktemp("cubin")
    (d / "k.cu").write_text(KERNEL_SOURCE)
    subprocess.run([nvcc, "-cubin", "-arch=sm_90", "-o", str(d / "k.cubin"), str(d / "k.cu")],
                   check=True, capture_output=True)
    return (d / "k.cubin").read_bytes()


def pattern(n: int, seed: int = 0) -> bytes:
    """Deterministic bytes that differ at every offset (a shifted copy never matches)."""
    return random.Random(seed).randbytes(n)


def launch(f: int, grid: int, block: int, params: bytes, attrs: bytes = b"") -> gp.Launch:
    """A 1-D launch message."""
    return gp.Launch(func=f, grid_x=grid, grid_y=1, grid_z=1, block_x=block, block_y=1, block_z=1,
                     shared_mem=0, stream=0, params=params, attrs=attrs)


def load_module(s: WorkerSession, mod_id: int, image: bytes, kind: int = 0) -> int:
    """The client's two-step load; returns the final result."""
    sha = hashlib.sha256(image).digest()
    msg = gp.ModuleLoad(module=mod_id, kind=kind, sha256=sha, image_size=len(image), data=0)
    reply, _ = s.call(msg)
    if reply.result == gp.GP_ENEEDIMAGE:
        msg.data = len(image)
        reply, _ = s.call(msg, image)
    return reply.result


# ---------------------------------------------------------------------------------- handshake
def test_hello_snapshot(session: WorkerSession) -> None:
    h = session.hello
    assert (h.major, h.minor) == (gp.MAJOR, gp.MINOR)
    assert "simulated" in h.name
    assert h.simulated == 1
    assert h.session_id == 0x1234
    assert h.server
    assert len(h.attributes) == 148
    assert h.attributes[75] == 9  # compute capability major of the H100-like default
    assert h.attributes[16] > 0  # multiprocessors
    assert h.pci_bus == h.attributes[33]
    assert len(h.limits) == 10
    assert h.granularity > 0 and h.granularity & (h.granularity - 1) == 0
    assert (h.va_base, h.va_size) == (wc.DEFAULT_VA_BASE, wc.DEFAULT_VA_SIZE)
    assert h.total_mem > 0 and h.driver_version > 0
    assert h.stream_priority_least >= h.stream_priority_greatest
    assert len(h.uuid) == 16


@pytest.mark.parametrize("base,size", [
    (0x300000000000, 1 << 40),     # the simulated device's own heap is there
    (0x7FFFFFE00000, 1 << 40),     # runs past the end of the address space
    (0x200000001000, 1 << 30),     # not aligned to the granularity
    (0x200000000000, 0),           # empty
])
def test_va_window_refused(cache_dir: Path, base: int, size: int) -> None:
    s = WorkerSession(cache_dir, va_base=base, va_size=size)
    assert s.hello.result == gp.GP_EVAWINDOW, s.hello
    assert s.hello.message
    assert s.wait() == 1
    check_clean(s)


def test_two_sessions_need_distinct_windows(cache_dir: Path) -> None:
    a = WorkerSession(cache_dir)
    b = WorkerSession(cache_dir)  # another process: the same window is free there
    assert a.hello.result == 0 and b.hello.result == 0
    assert a.close() == 0 and b.close() == 0


def test_bad_hello_on_stdin(cache_dir: Path) -> None:
    s = WorkerSession(cache_dir, hello_body=b"\x01\x02garbage")
    assert s.hello.result == gp.GP_EPROTO
    assert s.wait() == 1
    bad = gp.Hello(magic=gp.MAGIC, major=gp.MAJOR + 1, va_base=wc.DEFAULT_VA_BASE,
                   va_size=wc.DEFAULT_VA_SIZE)
    s = WorkerSession(cache_dir, hello=bad)
    assert s.hello.result == gp.GP_EVERSION
    assert s.wait() == 1


def test_usage_errors(tmp_path: Path) -> None:
    rc, err = wc.spawn_raw([])
    assert rc == 2 and "usage" in err
    # An error line carries its sd-daemon priority, which gpupoold's log keeps (worker_line).
    assert err.startswith("<3>gpupool-worker["), err
    rc, err = wc.spawn_raw(["--fd", "999", "--driver", str(wc.SIM), "--device", "0",
                            "--cache-dir", str(tmp_path), "--session-id", "1",
                            "--hello-req", "1"])
    assert rc == 2 and "--fd" in err
    rc, err = wc.spawn_raw(["--fd", "x", "--bogus"])
    assert rc == 2


def test_missing_driver_refused(cache_dir: Path) -> None:
    ours, theirs = socket.socketpair()
    hello = gp.Hello(magic=gp.MAGIC, major=gp.MAJOR, va_base=wc.DEFAULT_VA_BASE,
                     va_size=wc.DEFAULT_VA_SIZE)
    rc, err = wc.spawn_raw(
        ["--fd", str(theirs.fileno()), "--driver", "/nonexistent/libcuda.so.1", "--device", "0",
         "--cache-dir", str(cache_dir), "--session-id", "1", "--hello-req", "9"],
        stdin=hello.encode(), pass_fds=(theirs.fileno(),))
    theirs.close()
    assert rc == 1
    length, op, flags, req = gp.HEADER.unpack(ours.recv(16, socket.MSG_WAITALL))
    reply = gp.HelloReply.decode(ours.recv(length, socket.MSG_WAITALL))
    assert (op, flags, req) == (gp.Hello.OP, gp.FLAG_REPLY, 9)
    assert reply.result == gp.GP_EREFUSED and "nonexistent" in reply.message
    ours.close()


# ---------------------------------------------------------------------------------- memory
def test_alloc_copy_round_trips(session: WorkerSession) -> None:
    gran = session.hello.granularity
    for size, off in [(1, 0), (3, 5), (4095, 1), (65536, 0), (65537, 3), ((1 << 20) + 7, 11),
                      ((9 << 20) + 5, 4097), ((16 << 20) + 1, 0)]:
        a = session.alloc(size + off)
        assert a.result == 0
        assert a.dptr % gran == 0 and a.mapped_size % gran == 0 and a.mapped_size >= size + off
        assert wc.DEFAULT_VA_BASE <= a.dptr < wc.DEFAULT_VA_BASE + wc.DEFAULT_VA_SIZE
        data = pattern(size, seed=size)
        session.htod(a.dptr + off, data)
        rc, back = session.dtoh(a.dptr + off, size)
        assert rc == 0 and back == data, (size, off)
        session.post(gp.MemFree(dptr=a.dptr, stream=0))
    assert session.sync() == 0
    st = session.stats()
    assert st.h2d_bytes == st.d2h_bytes > 26 << 20


@pytest.fixture(params=["direct", "staged"])
def copy_session(request: pytest.FixtureRequest, cache_dir: Path):
    """A session whose large copies take the simulated device's direct path (socket <-> device
    memory, gpupoolSimHostPointer) or, forced by GPUPOOL_WORKER_STAGED_COPIES=1, the staging path
    that a real driver takes."""
    staged = request.param == "staged"
    s = WorkerSession(cache_dir, env={"GPUPOOL_WORKER_STAGED_COPIES": "1" if staged else "0"})
    assert s.hello.result == 0, s.hello.message
    yield s
    if s.proc.poll() is None:
        assert s.close() == 0, s.stderr_text()
    check_clean(s)
    assert ("direct copies" in s.stderr_text()) != staged, s.stderr_text()


def test_big_copy_chunked(copy_session: WorkerSession) -> None:
    session = copy_session
    size, off = (64 << 20) + 3, 7  # odd size at an odd offset: nothing is chunk-aligned
    a = session.alloc(size + off)
    assert a.result == 0
    data = os.urandom(size)
    session.htod(a.dptr + off, data)
    rc, back = session.dtoh(a.dptr + off, size)
    assert rc == 0
    assert hashlib.sha256(back).digest() == hashlib.sha256(data).digest()
    # The bytes around the range are untouched (fresh device memory reads zero).
    rc, edges = session.dtoh(a.dptr, off)
    assert rc == 0 and edges == b"\0" * off
    st = session.stats()
    assert (st.h2d_bytes, st.d2h_bytes) == (size, size + off)
    # Asynchronous variants on a stream, read back at an offset that straddles chunks.
    s = handle(H_STREAM, 1)
    session.post(gp.StreamCreate(stream=s, flags=1, priority=0))
    session.htod(a.dptr + 1, data[: (20 << 20)], stream=s, is_async=1)
    rc, back = session.dtoh(a.dptr + (8 << 20) - 5, 12 << 20, stream=s, is_async=1)
    assert rc == 0 and back == data[(8 << 20) - 6:(20 << 20) - 6]
    assert session.call(gp.StreamSynchronize(stream=s))[0].result == 0


def test_copy_errors(copy_session: WorkerSession) -> None:
    session = copy_session
    # A copy to an unmapped address: the data is still consumed, the error is deferred.
    bogus = wc.DEFAULT_VA_BASE + (512 << 30)
    session.htod(bogus, b"x" * 1000)
    session.htod(bogus, b"y" * (3 << 20))
    assert session.call(gp.Ping(token=5))[0].token == 5  # the stream is still in sync
    assert session.sync() != 0
    assert session.notices and session.notices[0].op == gp.MemcpyHtod.OP
    assert session.sync() == 0
    # Device to host from a bad address: an error reply without data (small and large paths).
    for size in (100, 10 << 20):
        rc, data = session.dtoh(bogus, size)
        assert rc != 0 and data == b""
    # A range that starts in an allocation and runs past its end.
    a = session.alloc(1 << 20)
    rc, data = session.dtoh(a.dptr, 40 << 20)
    assert rc != 0 and data == b""
    assert session.call(gp.Ping(token=6))[0].token == 6
    # Host to device into such a range: refused as a whole, the data still consumed.
    session.htod(a.dptr + a.mapped_size - 10, b"z" * (3 << 20))
    assert session.call(gp.Ping(token=7))[0].token == 7
    assert session.sync() == CUDA_ERROR_INVALID_VALUE
    assert "not device memory" in session.notices[-1].text, session.notices[-1].text
    rc, data = session.dtoh(a.dptr + a.mapped_size - 10, 10)
    assert rc == 0 and data == b"\0" * 10
    # Unknown stream.
    rc, _ = session.dtoh(wc.DEFAULT_VA_BASE, 10, stream=handle(H_STREAM, 77))
    assert rc == CUDA_ERROR_INVALID_HANDLE


def test_memset(session: WorkerSession) -> None:
    a = session.alloc(4096)
    for elem, value, count in [(1, 0xAB, 1001), (2, 0xBEEF, 301), (4, 0xDEADBEEF, 77)]:
        session.post(gp.Memset(dst=a.dptr, value=0, elem_size=1, count=4096, stream=0,
                               is_async=0))
        session.post(gp.Memset(dst=a.dptr + 4, value=value, elem_size=elem, count=count,
                               stream=0, is_async=1))
        rc, back = session.dtoh(a.dptr, 4096)
        assert rc == 0
        fmt = {1: "<B", 2: "<H", 4: "<I"}[elem]
        expect = b"\0" * 4 + struct.pack(fmt, value) * count
        assert back == expect + b"\0" * (4096 - len(expect))
    session.post(gp.Memset(dst=a.dptr, value=1, elem_size=3, count=1, stream=0, is_async=0))
    assert session.sync() == CUDA_ERROR_INVALID_VALUE


def test_memset_2d_and_dtod(session: WorkerSession) -> None:
    a = session.alloc(1 << 16)
    b = session.alloc(1 << 16)
    data = pattern(1 << 16)
    session.htod(a.dptr, data)
    session.post(gp.MemcpyDtod(dst=b.dptr + 3, src=a.dptr + 10, size=5000, stream=0,
                               is_async=0))
    rc, back = session.dtoh(b.dptr + 3, 5000)
    assert rc == 0 and back == data[10:5010]
    session.post(gp.Memset2d(dst=a.dptr, pitch=256, value=7, elem_size=1, width=16, height=4,
                             stream=0, is_async=0))
    rc = session.sync()
    if rc == CUDA_ERROR_NOT_SUPPORTED:
        assert any(n.op == gp.Memset2d.OP for n in session.notices)
    else:
        assert rc == 0
        rc, back = session.dtoh(a.dptr, 1024)
        assert back[:16] == b"\7" * 16 and back[256:272] == b"\7" * 16 and back[16] == data[16]


def test_out_of_memory(session: WorkerSession) -> None:
    assert session.alloc(1 << 50).result == CUDA_ERROR_OUT_OF_MEMORY  # larger than the window
    assert session.alloc(512 << 30).result == CUDA_ERROR_OUT_OF_MEMORY  # larger than the device
    assert session.alloc(0).result == CUDA_ERROR_INVALID_VALUE
    a = session.alloc(1 << 20)  # and the window is still usable
    assert a.result == 0
    info, _ = session.call(gp.MemGetInfo())
    assert info.result == 0 and 0 < info.free <= info.total


def test_window_reuse_after_free(session: WorkerSession) -> None:
    first = session.alloc(3 << 20)
    session.post(gp.MemFree(dptr=first.dptr, stream=0))
    again = session.alloc(3 << 20)
    assert again.result == 0 and again.dptr == first.dptr


def test_deferred_error_free_of_bogus_pointer(session: WorkerSession) -> None:
    session.post(gp.MemFree(dptr=0xDEAD000, stream=0))
    assert session.sync() == CUDA_ERROR_INVALID_VALUE
    n = session.notices[-1]
    assert n.code == CUDA_ERROR_INVALID_VALUE and n.op == gp.MemFree.OP and "0xdead000" in n.text
    assert session.sync() == 0  # not sticky: cleared


def test_first_deferred_error_wins(session: WorkerSession) -> None:
    session.post(gp.MemFree(dptr=0x1000, stream=0))
    session.post(gp.StreamDestroy(stream=handle(H_STREAM, 55)))
    assert session.sync() == CUDA_ERROR_INVALID_VALUE
    assert len(session.notices) == 2
    assert session.notices[1].code == CUDA_ERROR_INVALID_HANDLE
    assert session.sync() == 0


# ---------------------------------------------------------------------------------- contexts
def test_contexts(session: WorkerSession) -> None:
    c = handle(H_CTX, 2)
    assert session.call(gp.CtxCreate(ctx=c, flags=0))[0].result == 0
    assert session.call(gp.CtxCreate(ctx=c, flags=0))[0].result == CUDA_ERROR_INVALID_VALUE
    session.post(gp.CtxSetCurrent(ctx=c))
    a = session.alloc(1 << 20)
    assert a.result == 0
    s = handle(H_STREAM, 3)
    session.post(gp.StreamCreate(stream=s, flags=0, priority=0))
    session.htod(a.dptr, b"abc" * 100000, stream=s)  # staged: events in this context
    assert session.dtoh(a.dptr, 6, stream=s) == (0, b"abcabc")
    assert session.dtoh(a.dptr + 3, 299997, stream=s) == (0, b"abc" * 99999)
    session.post(gp.CtxSetCurrent(ctx=PRIMARY_CTX))
    assert session.call(gp.CtxDestroy(ctx=c))[0].result == 0
    # Its stream and memory went with it.
    assert session.call(gp.StreamSynchronize(stream=s))[0].result == CUDA_ERROR_INVALID_HANDLE
    assert session.call(gp.CtxDestroy(ctx=c))[0].result == CUDA_ERROR_INVALID_CONTEXT
    assert session.call(gp.CtxDestroy(ctx=PRIMARY_CTX))[0].result == CUDA_ERROR_INVALID_CONTEXT
    session.post(gp.CtxSetCurrent(ctx=handle(H_CTX, 99)))
    assert session.sync() == CUDA_ERROR_INVALID_CONTEXT
    # No current context: allocations fail like cuMemAlloc without one.
    session.post(gp.CtxSetCurrent(ctx=0))
    assert session.alloc(100).result == CUDA_ERROR_INVALID_CONTEXT
    session.post(gp.CtxSetCurrent(ctx=PRIMARY_CTX))
    assert session.alloc(100).result == 0


def test_destroying_current_context_falls_back_to_primary(session: WorkerSession) -> None:
    c = handle(H_CTX, 5)
    assert session.call(gp.CtxCreate(ctx=c, flags=0))[0].result == 0
    session.post(gp.CtxSetCurrent(ctx=c))
    assert session.call(gp.CtxDestroy(ctx=c))[0].result == 0
    assert session.alloc(100).result == 0
    assert session.sync() == 0


def test_limits(session: WorkerSession) -> None:
    r, _ = session.call(gp.CtxGetLimit(limit=0))
    assert r.result == 0 and r.value == session.hello.limits[0]
    assert session.call(gp.CtxSetLimit(limit=0, value=4096))[0].result == 0
    assert session.call(gp.CtxGetLimit(limit=0))[0].value == 4096
    assert session.call(gp.CtxGetLimit(limit=1000))[0].result != 0


def test_primary_ctx_reset(session: WorkerSession) -> None:
    a = session.alloc(4 << 20)
    s = handle(H_STREAM, 9)
    session.post(gp.StreamCreate(stream=s, flags=0, priority=0))
    session.htod(a.dptr, b"z" * (10 << 20 >> 2))  # staging buffers get allocated
    assert session.call(gp.PrimaryCtxReset())[0].result == 0
    assert session.call(gp.StreamSynchronize(stream=s))[0].result == CUDA_ERROR_INVALID_HANDLE
    b = session.alloc(4 << 20)
    assert b.result == 0 and b.dptr == a.dptr  # the whole window is free again
    data = os.urandom(9 << 20)
    session.htod(b.dptr, data[: 4 << 20])
    assert session.dtoh(b.dptr, 4 << 20) == (0, data[: 4 << 20])


# ---------------------------------------------------------------------------------- streams
def test_streams_and_events(session: WorkerSession) -> None:
    s = handle(H_STREAM, 1)
    e1, e2 = handle(H_EVENT, 1), handle(H_EVENT, 2)
    session.post(gp.StreamCreate(stream=s, flags=1, priority=session.hello.stream_priority_greatest))
    session.post(gp.EventCreate(event=e1, flags=0))
    session.post(gp.EventCreate(event=e2, flags=0))
    a = session.alloc(1 << 20)
    session.post(gp.EventRecord(event=e1, stream=s, flags=0))
    session.htod(a.dptr, b"q" * (1 << 20), stream=s, is_async=1)
    session.post(gp.EventRecord(event=e2, stream=s, flags=0))
    session.post(gp.StreamWaitEvent(stream=0, event=e2, flags=0))
    assert session.call(gp.StreamSynchronize(stream=s))[0].result == 0
    assert session.call(gp.StreamQuery(stream=s))[0].result == 0
    assert session.call(gp.EventQuery(event=e2))[0].result == 0
    assert session.call(gp.EventSynchronize(event=e2))[0].result == 0
    r, _ = session.call(gp.EventElapsedTime(start=e1, end=e2))
    assert r.result == 0 and r.ms >= 0.0
    for legacy in (0, 1, 2):
        assert session.call(gp.StreamSynchronize(stream=legacy))[0].result == 0
    session.post(gp.StreamDestroy(stream=s))
    session.post(gp.EventDestroy(event=e1))
    assert session.call(gp.StreamQuery(stream=s))[0].result == CUDA_ERROR_INVALID_HANDLE
    r, _ = session.call(gp.EventElapsedTime(start=e1, end=e2))
    assert r.result == CUDA_ERROR_INVALID_HANDLE
    assert session.sync() == 0
    session.post(gp.EventRecord(event=e1, stream=0, flags=0))
    assert session.sync() == CUDA_ERROR_INVALID_HANDLE
    session.post(gp.StreamCreate(stream=1, flags=0, priority=0))  # a reserved id
    assert session.sync() == CUDA_ERROR_INVALID_VALUE


# ---------------------------------------------------------------------------------- modules
def token_session(cache_dir: Path, token: str, env: dict[str, str] | None = None) -> WorkerSession:
    """A session whose hello carries `token` (the daemon hands the worker the client's hello)."""
    hello = gp.Hello(magic=gp.MAGIC, major=gp.MAJOR, minor=gp.MINOR, pid=os.getpid(),
                     host="testhost", user="tester", program="test_worker", token=token,
                     gpu="", model="", min_memory=0, va_base=wc.DEFAULT_VA_BASE,
                     va_size=wc.DEFAULT_VA_SIZE)
    s = WorkerSession(cache_dir, hello=hello, env=env)
    assert s.hello.result == 0, s.hello.message
    return s


def namespace(token: str) -> str:
    """The cache folder of a token's images (worker/modcache.c, wk_modcache_namespace)."""
    return hashlib.sha256(b"gpupool module cache\0" + token.encode()).hexdigest()[:16]


def hash_only(s: WorkerSession, mod_id: int, image: bytes) -> int:
    """A module_load that claims the server has the image: its hash and size, no bytes."""
    r, _ = s.call(gp.ModuleLoad(module=mod_id, kind=0, sha256=hashlib.sha256(image).digest(),
                                image_size=len(image), data=0))
    return r.result  # type: ignore[attr-defined,no-any-return]


def test_module_cache_across_sessions(cache_dir: Path, cubin: bytes) -> None:
    m = handle(H_MODULE, 1)
    sha = hashlib.sha256(cubin).digest()
    ns = cache_dir / "modules" / namespace("")  # WorkerSession's hello has no token
    s1 = WorkerSession(cache_dir)
    r, _ = s1.call(gp.ModuleLoad(module=m, kind=0, sha256=sha, image_size=len(cubin), data=0))
    assert r.result == gp.GP_ENEEDIMAGE
    r, _ = s1.call(gp.ModuleLoad(module=m, kind=0, sha256=sha, image_size=len(cubin),
                                 data=len(cubin)), cubin)
    assert r.result == 0
    st = s1.stats()
    assert (st.module_bytes_received, st.modules_loaded, st.module_cache_hits) == (len(cubin), 1, 0)
    # Same session, another module id: the memory cache answers.
    r, _ = s1.call(gp.ModuleLoad(module=handle(H_MODULE, 2), kind=0, sha256=sha,
                                 image_size=len(cubin), data=0))
    assert r.result == 0
    assert (ns / sha.hex()).read_bytes() == cubin
    assert not [p for p in ns.iterdir() if p.name.startswith(".tmp")]
    assert s1.close() == 0

    s2 = WorkerSession(cache_dir)
    r, _ = s2.call(gp.ModuleLoad(module=m, kind=0, sha256=sha, image_size=len(cubin), data=0))
    assert r.result == 0
    st = s2.stats()
    assert (st.module_bytes_received, st.modules_loaded, st.module_cache_hits) == (0, 1, 1)
    assert s2.close() == 0
    check_clean(s1)
    check_clean(s2)


def test_module_cache_corrupt_file_is_a_miss(cache_dir: Path, cubin: bytes) -> None:
    sha = hashlib.sha256(cubin).digest()
    ns = cache_dir / "modules" / namespace("")
    ns.mkdir(parents=True)
    damaged = bytearray(cubin)
    damaged[100] ^= 0xFF
    (ns / sha.hex()).write_bytes(bytes(damaged))
    s = WorkerSession(cache_dir)
    assert hash_only(s, handle(H_MODULE, 1), cubin) == gp.GP_ENEEDIMAGE
    assert load_module(s, handle(H_MODULE, 1), cubin) == 0
    assert (ns / sha.hex()).read_bytes() == cubin  # replaced
    assert s.close() == 0


def test_module_cache_is_per_token(cache_dir: Path, cubin: bytes) -> None:
    """A token that never uploaded an image cannot load it by its hash: the worker asks for the
    image, as for one it never saw; the owner still finds it. No token is in a file name."""
    sha = hashlib.sha256(cubin).hexdigest()
    a_token, b_token = "gp_tenant_a_secret", "gp_tenant_b_secret"
    a = token_session(cache_dir, a_token)
    assert load_module(a, handle(H_MODULE, 1), cubin) == 0
    assert a.close() == 0
    assert (cache_dir / "modules" / namespace(a_token) / sha).read_bytes() == cubin

    b = token_session(cache_dir, b_token)
    assert hash_only(b, handle(H_MODULE, 1), cubin) == gp.GP_ENEEDIMAGE
    st = b.stats()
    assert (st.modules_loaded, st.module_cache_hits) == (0, 0)
    assert b.call(gp.GetFunction(module=handle(H_MODULE, 1), func=handle(H_FUNC, 1), kind=0,
                                 name="gp_test_axpy"))[0].result == CUDA_ERROR_INVALID_HANDLE
    assert load_module(b, handle(H_MODULE, 1), cubin) == 0  # with the image, it loads
    assert b.stats().module_bytes_received == len(cubin)
    assert b.close() == 0

    a2 = token_session(cache_dir, a_token)
    assert hash_only(a2, handle(H_MODULE, 1), cubin) == 0
    assert a2.stats().module_cache_hits == 1
    assert a2.close() == 0
    names = [str(p.relative_to(cache_dir)) for p in cache_dir.rglob("*")]
    assert sorted(names) == sorted([
        "modules", f"modules/{namespace(a_token)}", f"modules/{namespace(a_token)}/{sha}",
        f"modules/{namespace(b_token)}", f"modules/{namespace(b_token)}/{sha}"]), names
    for s in (a, b, a2):
        check_clean(s)


def limits(token_files: int, total_files: int, memory_bytes: int = 1 << 30) -> dict[str, str]:
    """Small cache limits (file counts; bytes unbounded in practice)."""
    big = 1 << 40
    return {"GPUPOOL_WORKER_MODCACHE_LIMITS": f"{big},{token_files},{big},{total_files},{memory_bytes}"}


def test_module_cache_eviction(cache_dir: Path) -> None:
    """Each token's images are bounded (least recently used go first, a hit counts as a use);
    over the total, the namespace holding the most bytes loses its oldest, so a tenant filling
    its share evicts its own images, not another's. Old flat entries and stale temporary files
    are removed; anything else is left alone. (The images are junk the driver refuses: they are
    cached before the load all the same.)"""
    env = limits(token_files=3, total_files=5)
    root = cache_dir / "modules"
    root.mkdir(parents=True)
    old = root / hashlib.sha256(b"old layout").hexdigest()
    old.write_bytes(b"old layout")
    stale = root / ".tmp-1-0"
    stale.write_bytes(b"x")
    os.utime(stale, (1, 1))
    fresh_tmp = root / ".tmp-2-0"
    fresh_tmp.write_bytes(b"x")
    other = root / "README"
    other.write_bytes(b"not ours")

    def upload(tok: str, images: list[bytes], **kw: int) -> None:
        s = token_session(cache_dir, tok, env)
        for i, image in enumerate(images, 1):
            assert load_module(s, handle(H_MODULE, i), image) != gp.GP_ENEEDIMAGE
        assert s.close() == 0
        check_clean(s)

    def cached(tok: str) -> set[bytes]:
        return {p.read_bytes() for p in (root / namespace(tok)).iterdir()}

    a_img = [pattern(8192, seed) for seed in range(1, 6)]
    upload("A", a_img[:3])
    assert cached("A") == set(a_img[:3])
    for age, image in enumerate(a_img[:3], 1):  # a1 oldest
        os.utime(root / namespace("A") / hashlib.sha256(image).hexdigest(), (age, age))
    upload("A", a_img[3:4])
    assert cached("A") == set(a_img[1:4])  # a1 evicted
    assert not old.exists() and not stale.exists()
    assert fresh_tmp.exists() and other.exists()

    for age, image in enumerate(a_img[1:4], 1):
        os.utime(root / namespace("A") / hashlib.sha256(image).hexdigest(), (age, age))
    s = token_session(cache_dir, "A", env)
    assert hash_only(s, handle(H_MODULE, 1), a_img[1]) != gp.GP_ENEEDIMAGE  # a2 used again
    assert s.close() == 0
    upload("A", a_img[4:5])
    assert cached("A") == {a_img[1], a_img[3], a_img[4]}  # a3 was the least recently used

    # B's bigger images: over the total (six files of five), B holds the most bytes and loses
    # one of its own; A keeps all three.
    b_img = [pattern(16384, seed) for seed in range(11, 14)]
    upload("B", b_img)
    assert cached("A") == {a_img[1], a_img[3], a_img[4]}
    assert len(cached("B")) == 2 and cached("B") < set(b_img)


def test_module_cache_scans_in_steps(cache_dir: Path) -> None:
    """The eviction scan runs after a session's first image written, then after every 1/256 of
    a token's file limit (here 2 images): between scans the cache may be over its limit."""
    env = limits(token_files=512, total_files=3)
    ns = cache_dir / "modules" / namespace("A")
    s = token_session(cache_dir, "A", env)
    counts = []
    for i in range(1, 6):
        assert load_module(s, handle(H_MODULE, i), pattern(4096, i)) != gp.GP_ENEEDIMAGE
        counts.append(len(list(ns.iterdir())))
    assert s.close() == 0
    check_clean(s)
    assert counts == [1, 2, 3, 4, 3], counts  # scans after the 1st, 3rd and 5th


def test_module_memory_cache_bounded(cache_dir: Path) -> None:
    """A session keeps at most its memory limit of images; the rest come back from disk."""
    env = limits(token_files=100, total_files=100, memory_bytes=12000)
    one, two = pattern(8192, 1), pattern(8192, 2)
    s = token_session(cache_dir, "A", env)
    assert load_module(s, handle(H_MODULE, 1), one) != gp.GP_ENEEDIMAGE
    assert load_module(s, handle(H_MODULE, 2), two) != gp.GP_ENEEDIMAGE
    ns = cache_dir / "modules" / namespace("A")
    (ns / hashlib.sha256(one).hexdigest()).unlink()
    (ns / hashlib.sha256(two).hexdigest()).unlink()
    assert hash_only(s, handle(H_MODULE, 3), two) != gp.GP_ENEEDIMAGE  # still in memory
    assert hash_only(s, handle(H_MODULE, 4), one) == gp.GP_ENEEDIMAGE  # dropped from memory
    assert s.close() == 0
    check_clean(s)


def test_module_image_mismatch(session: WorkerSession, cubin: bytes) -> None:
    sha = hashlib.sha256(b"something else").digest()
    r, _ = session.call(gp.ModuleLoad(module=handle(H_MODULE, 1), kind=0, sha256=sha,
                                      image_size=len(cubin), data=len(cubin)), cubin)
    assert r.result == gp.GP_EPROTO
    assert session.notices[-1].code == gp.GP_EPROTO
    r, _ = session.call(gp.ModuleLoad(module=handle(H_MODULE, 1), kind=7, sha256=sha,
                                      image_size=3, data=3), b"abc")
    assert r.result == CUDA_ERROR_INVALID_VALUE
    r, _ = session.call(gp.ModuleLoad(module=handle(H_MODULE, 1), kind=0,
                                      sha256=hashlib.sha256(b"junk").digest(), image_size=4,
                                      data=4), b"junk")
    assert r.result != 0  # not an image the driver can load
    assert session.call(gp.Ping(token=77))[0].token == 77


@pytest.mark.parametrize("kind", [0, 1])
def test_get_function_and_launch(session: WorkerSession, cubin: bytes, kind: int) -> None:
    m = handle(H_LIBRARY if kind else H_MODULE, 1)
    f = handle(H_KERNEL if kind else H_FUNC, 1)
    assert load_module(session, m, cubin, kind) == 0
    r, _ = session.call(gp.GetFunction(module=m, kind=kind, func=f, name="gp_test_axpy"))
    assert r.result == 0
    assert r.param_count == 4
    assert list(r.param_sizes) == [4, 8, 8, 4]
    assert list(r.param_offsets) == [0, 8, 16, 24]
    r, _ = session.call(gp.GetFunction(module=m, kind=kind, func=handle(H_FUNC, 2),
                                       name="no_such_kernel"))
    assert r.result == CUDA_ERROR_NOT_FOUND
    r, _ = session.call(gp.GetFunction(module=handle(H_MODULE, 42), kind=kind, func=handle(H_FUNC, 3),
                                       name="gp_test_axpy"))
    assert r.result == CUDA_ERROR_INVALID_HANDLE

    n = 1000
    xs = [float(i) for i in range(n)]
    ys = [float(3 * i + 1) for i in range(n)]
    x = session.alloc(4 * n)
    y = session.alloc(4 * n)
    session.htod(x.dptr, struct.pack(f"<{n}f", *xs))
    session.htod(y.dptr, struct.pack(f"<{n}f", *ys))
    params = struct.pack("<f4xQQi", 2.5, x.dptr, y.dptr, n)
    session.post(launch(f, (n + 127) // 128, 128, params))
    rc, back = session.dtoh(y.dptr, 4 * n)
    assert rc == 0
    assert list(struct.unpack(f"<{n}f", back)) == [2.5 * a + b for a, b in zip(xs, ys)]

    # cuLaunchKernelEx with a cluster-dimension attribute (id 4): 1x1x1 is valid.
    attr = struct.pack("<i4xIII", 4, 1, 1, 1).ljust(72, b"\0")
    session.post(launch(f, 8, 128, params, attr))
    assert session.sync() == 0
    assert session.stats().launches == 2
    # A malformed attribute blob is a deferred error, not a crash.
    session.post(launch(f, 1, 1, params, b"\1" * 10))
    assert session.sync() == CUDA_ERROR_INVALID_VALUE
    assert "gp_test_axpy" in session.notices[-1].text

    r, _ = session.call(gp.FuncGetAttribute(func=f, attribute=0))
    assert r.result == 0 and r.value > 0
    assert session.call(gp.FuncGetAttribute(func=handle(H_FUNC, 99), attribute=0))[0].result \
        == CUDA_ERROR_INVALID_HANDLE
    r, _ = session.call(gp.Occupancy(kind=0, func=f, block_size=128, dyn_smem=0, flags=0,
                                     attrs=b""))
    assert r.result == 0 and r.value > 0
    r, _ = session.call(gp.Occupancy(kind=9, func=f, attrs=b""))
    assert r.result == CUDA_ERROR_INVALID_VALUE

    g, _ = session.call(gp.GetGlobal(module=m, kind=kind, name="gp_test_value"))
    assert g.result == 0 and g.size == 4
    assert session.dtoh(g.dptr, 4) == (0, struct.pack("<i", 42))

    session.post(gp.ModuleUnload(module=m, kind=kind))
    assert session.sync() == 0
    session.post(launch(f, 1, 1, params))
    assert session.sync() == CUDA_ERROR_INVALID_HANDLE


def test_sticky_error(session: WorkerSession, cubin: bytes) -> None:
    m, f = handle(H_MODULE, 1), handle(H_FUNC, 1)
    assert load_module(session, m, cubin) == 0
    assert session.call(gp.GetFunction(module=m, kind=0, func=f, name="gp_test_axpy"))[0].result == 0
    params = struct.pack("<f4xQQi", 1.0, 0x10, 0x20, 16)  # not device memory
    session.post(launch(f, 1, 16, params))
    assert session.sync() == CUDA_ERROR_ILLEGAL_ADDRESS
    text = session.notices[-1].text
    assert "gp_test_axpy" in text and "CUDA_ERROR_ILLEGAL_ADDRESS" in text
    assert session.sync() == CUDA_ERROR_ILLEGAL_ADDRESS  # sticky
    assert session.dtoh(wc.DEFAULT_VA_BASE, 4)[0] == CUDA_ERROR_ILLEGAL_ADDRESS


# ---------------------------------------------------------------------------------- protocol
def test_ping_batch(session: WorkerSession) -> None:
    frames = b"".join(gp.encode_frame(gp.Ping(token=i), 1000 + i) for i in range(2000))
    session.sock.sendall(frames)
    for i in range(2000):
        op, req, body = session.recv_frame()
        assert (op, req) == (gp.Ping.OP, 1000 + i)
        assert gp.PingReply.decode(body).token == i
    assert session.stats().frames >= 2000


def expect_protocol_close(s: WorkerSession, raw: bytes) -> None:
    s.sock.sendall(raw)
    with pytest.raises(EOFError):
        s.recv_frame()
    assert s.notices and s.notices[-1].code == gp.GP_EPROTO
    assert s.wait() == 0
    check_clean(s)


@pytest.mark.parametrize("raw", [
    gp.HEADER.pack(3, gp.MemAlloc.OP, 0, 5) + b"abc",                 # short body
    gp.HEADER.pack(40, gp.MemAlloc.OP, 0, 5) + b"\0" * 40,            # trailing bytes
    gp.HEADER.pack(0, 999, 0, 5),                                      # unknown op
    gp.HEADER.pack(gp.MAX_BODY + 1, gp.Ping.OP, 0, 5),                 # oversized
    gp.HEADER.pack(8, gp.Ping.OP, gp.FLAG_REPLY, 5) + b"\0" * 8,       # a reply from the client
    gp.encode_frame(gp.Hello(magic=gp.MAGIC), 5),                      # a second hello
    gp.HEADER.pack(12, gp.GetFunction.OP, 0, 5) + b"\xff" * 12,        # string length overflows
])
def test_malformed_frame_closes(cache_dir: Path, raw: bytes) -> None:
    expect_protocol_close(WorkerSession(cache_dir), raw)


def test_client_eof_mid_frame_and_mid_bulk(cache_dir: Path) -> None:
    s = WorkerSession(cache_dir)
    s.sock.sendall(gp.HEADER.pack(100, gp.Ping.OP, 0, 1) + b"\0" * 10)
    s.sock.shutdown(socket.SHUT_WR)
    assert s.wait() == 0
    check_clean(s)
    s = WorkerSession(cache_dir)
    a = s.alloc(1 << 20)
    s.sock.sendall(gp.encode_frame(gp.MemcpyHtod(dst=a.dptr, stream=0, is_async=0,
                                                 data=1 << 20)) + b"\0" * 1000)
    s.sock.shutdown(socket.SHUT_WR)
    assert s.wait() == 0
    check_clean(s)


def test_client_eof_ends_session(cache_dir: Path) -> None:
    s = WorkerSession(cache_dir)
    s.alloc(1 << 20)
    s.sock.shutdown(socket.SHUT_WR)
    assert s.wait() == 0
    assert "client closed the connection" in s.stderr_text()
    check_clean(s)


def test_notice_from_client_is_ignored(session: WorkerSession) -> None:
    session.post(gp.Notice(code=1, op=2, text="hello from the client"))
    assert session.call(gp.Ping(token=1))[0].token == 1


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_random_calls_never_crash(session: WorkerSession, cubin: bytes, seed: int) -> None:
    """Well-formed frames with random handles, pointers and sizes: every one gets its reply or
    a deferred error, and the worker stays up (and sanitizer-clean)."""

    rng = random.Random(seed)
    m, f = handle(H_MODULE, 1), handle(H_FUNC, 1)
    assert load_module(session, m, cubin) == 0
    assert session.call(gp.GetFunction(module=m, kind=0, func=f, name="gp_test_axpy"))[0].result == 0
    buf = session.alloc(1 << 20).dptr
    ids = [0, 1, 2, 3, buf, buf + 4096, f, m, PRIMARY_CTX, handle(H_STREAM, 1), handle(H_EVENT, 1),
           handle(H_CTX, 2), 0xFFFFFFFFFFFFFFFF, rng.getrandbits(64)]

    def pick() -> int:
        return rng.choice(ids)

    def size() -> int:
        return rng.choice([0, 1, 7, 4096, 1 << 20, (1 << 20) + 1, 1 << 40, 1 << 63])

    makers = [
        lambda: gp.StreamCreate(stream=pick(), flags=rng.getrandbits(32), priority=rng.randint(-9, 9)),
        lambda: gp.StreamDestroy(stream=pick()),
        lambda: gp.EventCreate(event=pick(), flags=rng.getrandbits(4)),
        lambda: gp.EventDestroy(event=pick()),
        lambda: gp.EventRecord(event=pick(), stream=pick(), flags=rng.getrandbits(2)),
        lambda: gp.StreamWaitEvent(stream=pick(), event=pick(), flags=rng.getrandbits(2)),
        lambda: gp.MemFree(dptr=pick(), stream=pick()),
        lambda: gp.MemcpyDtod(dst=pick(), src=pick(), size=size(), stream=pick(), is_async=1),
        lambda: gp.Memset(dst=pick(), value=rng.getrandbits(32), elem_size=rng.choice([0, 1, 2, 4, 8]),
                          count=size(), stream=pick(), is_async=rng.getrandbits(1)),
        lambda: gp.Launch(func=pick(), grid_x=rng.randint(0, 3), grid_y=1, grid_z=1,
                          block_x=rng.randint(0, 2048), block_y=1, block_z=1, shared_mem=0,
                          stream=pick(), params=rng.randbytes(rng.choice([0, 4, 28, 100])),
                          attrs=rng.randbytes(rng.choice([0, 72, 71]))),
        lambda: gp.CtxSetCurrent(ctx=rng.choice([PRIMARY_CTX, PRIMARY_CTX, 0, pick()])),
        lambda: gp.ModuleUnload(module=pick(), kind=rng.getrandbits(2)),
        lambda: gp.MemAlloc(size=size(), stream=pick(), flags=rng.getrandbits(32)),
        lambda: gp.MemcpyDtoh(src=pick(), size=rng.choice([0, 1, 100, 70000]), stream=pick(),
                              is_async=rng.getrandbits(1)),
        lambda: gp.StreamQuery(stream=pick()),
        lambda: gp.EventElapsedTime(start=pick(), end=pick()),
        lambda: gp.FuncGetAttribute(func=pick(), attribute=rng.randint(-5, 20)),
        lambda: gp.FuncSetAttribute(func=pick(), attribute=rng.randint(-1, 20), value=rng.getrandbits(16)),
        lambda: gp.Occupancy(kind=rng.randint(0, 4), func=pick(), block_size=rng.randint(-1, 2048),
                             dyn_smem=size(), flags=rng.getrandbits(2), grid_x=rng.randint(0, 4), grid_y=1,
                             grid_z=1, block_x=rng.randint(0, 256), block_y=1, block_z=1,
                             attrs=rng.randbytes(rng.choice([0, 72, 5]))),
        lambda: gp.GetGlobal(module=pick(), kind=rng.getrandbits(2), name=rng.choice(["", "x", "gp_test_value"])),
        lambda: gp.CtxGetLimit(limit=rng.getrandbits(32)),
        lambda: gp.CtxDestroy(ctx=pick()),
    ]
    for _ in range(3000):
        msg = rng.choice(makers)()
        if msg.OP in gp.REPLIES:
            session.call(msg)
        else:
            session.post(msg)
        if rng.random() < 0.05:
            session.post(gp.CtxSetCurrent(ctx=PRIMARY_CTX))
            session.sync()
            session.sync()  # the first one may report a deferred error
    session.post(gp.CtxSetCurrent(ctx=PRIMARY_CTX))
    assert session.call(gp.Ping(token=99))[0].token == 99


def test_sigterm_ends_the_session_cleanly(cache_dir: Path) -> None:
    s = WorkerSession(cache_dir)
    a = s.alloc(1 << 20)
    assert a.result == 0
    assert s.call(gp.Ping(token=3))[0].token == 3  # the worker now waits for us
    s.proc.send_signal(signal.SIGTERM)
    with pytest.raises(EOFError):
        s.recv_frame()
    assert s.notices and "shutting down" in s.notices[-1].text
    assert s.wait() == 0
    check_clean(s)
