"""The worker's memory quota on a shared GPU (issue 32, items 2-4; worker/quota.c).

A session with worker_session's memory_quota (here --memory-quota, the --fd mode's form of it)
counts every device byte its tenant holds and refuses the first byte past the quota with
CUDA_ERROR_OUT_OF_MEMORY, one test per allocation path; cuMemGetInfo and the hello reply say the
quota; and everything the tenant held goes back to the driver as zeros, which the simulated
device's memory file (device memory that outlives the process, handed out again in the same
order) makes visible: without the zeroing the next tenant reads the first one's bytes.
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import worker_client as wc
from conftest import REPO, SANITIZER_MARKS, require, run_client
from worker_client import WorkerSession, gp, handle

SCRIPTS = REPO / "tests" / "torch_scripts"
MiB = 1 << 20
QUOTA = 64 * MiB
OOM = 2  # CUDA_ERROR_OUT_OF_MEMORY
H_MODULE, H_VMM = 4, 18
LEGACY_STREAM = 1  # CU_STREAM_LEGACY: a stream-ordered allocation (cuMemAllocAsync)

# A module with an 8 MiB global (the simulated device places it at its first request).
GLOBAL_SOURCE = r"""
extern "C" __device__ unsigned char gp_quota_big[8 << 20];
extern "C" __global__ void gp_test_noop() { gp_quota_big[threadIdx.x] = 1; }
"""


@pytest.fixture(autouse=True)
def _built() -> None:
    require(wc.WORKER.exists(), "gpupool-worker is not built")
    require(wc.SIM.exists(), "the simulated device (libgpupool-sim.so) is not built")


def session(tmp_path: Path, quota: int = QUOTA, memory_file: Path | None = None) -> WorkerSession:
    env = {"GPUPOOL_SIM_MEMORY_FILE": str(memory_file)} if memory_file else {}
    return WorkerSession(tmp_path / "cache", env=env, extra_args=["--memory-quota", str(quota)])


def mem_info(s: WorkerSession) -> tuple[int, int]:
    r, _ = s.call(gp.MemGetInfo())
    assert r.result == 0  # type: ignore[attr-defined]
    return r.free, r.total  # type: ignore[attr-defined]


def close(s: WorkerSession) -> None:
    assert s.close() == 0, s.stderr_text()
    clean(s)


def clean(s: WorkerSession) -> None:
    """No sanitizer report and no failed zeroing in the worker's log."""
    log = s.stderr_text()
    for bad in (*SANITIZER_MARKS, "Segmentation", "Aborted", "must be scrubbed whole"):
        assert bad not in log, log[-4000:]


@pytest.mark.san  # scripts/test.sh runs it against the sanitizer build too
def test_quota_in_hello_and_mem_info(tmp_path: Path) -> None:
    s = session(tmp_path)
    assert s.hello.memory_quota == QUOTA
    assert mem_info(s) == (QUOTA, QUOTA)
    a = s.alloc(3 * MiB)  # rounded to the granularity: what the tenant holds
    assert a.result == 0 and a.mapped_size == 4 * MiB
    assert mem_info(s) == (QUOTA - 4 * MiB, QUOTA)
    s.post(gp.MemFree(dptr=a.dptr, stream=0))
    assert mem_info(s) == (QUOTA, QUOTA)
    close(s)
    # Without a quota the driver's own figures, as before (the simulated H100: 80 GiB).
    w = WorkerSession(tmp_path / "cache")
    assert w.hello.memory_quota == 0
    assert mem_info(w)[1] == 80 << 30
    close(w)


@pytest.mark.san  # scripts/test.sh runs it against the sanitizer build too
@pytest.mark.parametrize("stream", [0, LEGACY_STREAM], ids=["cuMemAlloc", "cuMemAllocAsync"])
def test_alloc_at_quota_and_first_byte_past(tmp_path: Path, stream: int) -> None:
    s = session(tmp_path)
    assert s.alloc(QUOTA + 1, stream).result == OOM  # alone past it
    a = s.alloc(QUOTA, stream)
    assert a.result == 0  # exactly the quota
    assert s.alloc(1, stream).result == OOM  # the first byte past it
    assert mem_info(s) == (0, QUOTA)
    s.post(gp.MemFree(dptr=a.dptr, stream=stream))
    assert s.alloc(QUOTA, stream).result == 0  # freed memory counts no more
    close(s)


@pytest.mark.san  # scripts/test.sh runs it against the sanitizer build too
def test_vmm_create_counts(tmp_path: Path) -> None:
    s = session(tmp_path)
    r, _ = s.call(gp.VmmCreate(handle=handle(H_VMM, 1), size=QUOTA - 2 * MiB))
    assert r.result == 0  # type: ignore[attr-defined]
    assert mem_info(s) == (2 * MiB, QUOTA)
    r, _ = s.call(gp.VmmCreate(handle=handle(H_VMM, 2), size=4 * MiB))
    assert r.result == OOM  # type: ignore[attr-defined]
    assert s.alloc(4 * MiB).result == OOM  # one quota for every path
    r, _ = s.call(gp.VmmCreate(handle=handle(H_VMM, 2), size=2 * MiB))
    assert r.result == 0  # type: ignore[attr-defined]
    s.post(gp.VmmRelease(handle=handle(H_VMM, 1)))
    assert mem_info(s) == (QUOTA - 2 * MiB, QUOTA)
    close(s)


@pytest.fixture(scope="module")
def global_cubin(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    require(Path(nvcc).exists(), "nvcc is not installed (needed to build the test cubin)")
    d = tmp_path_factory.mktemp("quota_cubin")
    (d / "g.cu").write_text(GLOBAL_SOURCE)
    subprocess.run([nvcc, "-cubin", "-arch=sm_90", "-o", str(d / "g.cubin"), str(d / "g.cu")],
                   check=True, capture_output=True)
    return (d / "g.cubin").read_bytes()


def load(s: WorkerSession, mod: int, image: bytes) -> int:
    r, _ = s.call(gp.ModuleLoad(module=mod, kind=0, sha256=hashlib.sha256(image).digest(),
                                image_size=len(image), data=len(image)), image)
    return r.result  # type: ignore[attr-defined,no-any-return]


@pytest.mark.san  # scripts/test.sh runs it against the sanitizer build too
def test_module_globals_count(tmp_path: Path, global_cubin: bytes) -> None:
    s = session(tmp_path)
    mod = handle(H_MODULE, 1)
    assert load(s, mod, global_cubin) == 0
    r, _ = s.call(gp.GetGlobal(module=mod, kind=0, name="gp_quota_big"))
    assert r.result == 0 and r.size == 8 * MiB  # type: ignore[attr-defined]
    free, total = mem_info(s)
    assert total == QUOTA and QUOTA - free >= 8 * MiB
    assert s.alloc(free + 1).result == OOM
    assert s.alloc(free // (2 * MiB) * (2 * MiB)).result == 0
    s.post(gp.ModuleUnload(module=mod, kind=0))
    assert mem_info(s)[0] >= 8 * MiB  # the module's memory is the tenant's no more
    close(s)


@pytest.mark.san  # scripts/test.sh runs it against the sanitizer build too
def test_module_of_a_destroyed_context_counts_no_more(tmp_path: Path, global_cubin: bytes) -> None:
    """cuCtxDestroy unloads the context's modules: their charge is returned (and their globals
    zeroed, with that context current)."""
    s = session(tmp_path)
    ctx = handle(1, 2)
    assert s.call(gp.CtxCreate(ctx=ctx, flags=0))[0].result == 0  # type: ignore[attr-defined]
    s.post(gp.CtxSetCurrent(ctx=ctx))
    mod = handle(H_MODULE, 1)
    assert load(s, mod, global_cubin) == 0
    r, _ = s.call(gp.GetGlobal(module=mod, kind=0, name="gp_quota_big"))
    assert r.result == 0  # type: ignore[attr-defined]
    assert QUOTA - mem_info(s)[0] >= 8 * MiB
    assert s.call(gp.CtxDestroy(ctx=ctx))[0].result == 0  # type: ignore[attr-defined]
    assert mem_info(s) == (QUOTA, QUOTA)
    close(s)


@pytest.mark.san  # scripts/test.sh runs it against the sanitizer build too
def test_module_past_quota_is_refused(tmp_path: Path, global_cubin: bytes) -> None:
    s = session(tmp_path, quota=4 * MiB)
    mod = handle(H_MODULE, 1)
    assert load(s, mod, global_cubin) == 0
    r, _ = s.call(gp.GetGlobal(module=mod, kind=0, name="gp_quota_big"))
    assert r.result == OOM  # type: ignore[attr-defined]
    close(s)


def fill(s: WorkerSession, ptr: int, size: int) -> None:
    s.htod(ptr, b"\xab" * size)
    assert s.sync() == 0


def leftovers(s: WorkerSession, ptr: int, size: int) -> int:
    """Bytes of [ptr, ptr+size) that are not zero (a count: pytest's diff of 8 MiB is slow)."""
    rc, data = s.dtoh(ptr, size)
    assert rc == 0 and len(data) == size
    return size - data.count(0)


def vmm_mapped(s: WorkerSession, h: int, size: int) -> int:
    """Physical memory h of size bytes, mapped read-write at a reservation of its own."""
    r, _ = s.call(gp.VmmCreate(handle=h, size=size))
    assert r.result == 0  # type: ignore[attr-defined]
    res, _ = s.call(gp.VmmReserve(size=size, alignment=0, addr=0))
    assert res.result == 0  # type: ignore[attr-defined]
    ptr: int = res.ptr  # type: ignore[attr-defined]
    s.post(gp.VmmMap(ptr=ptr, size=size, offset=0, handle=h))
    s.post(gp.VmmSetAccess(ptr=ptr, size=size, flags=3))  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return ptr


@pytest.mark.san  # scripts/test.sh runs it against the sanitizer build too
@pytest.mark.parametrize("end", ["free", "killed"])
def test_nothing_left_behind(tmp_path: Path, end: str) -> None:
    """The isolation pattern: a tenant takes every byte its quota gives it (half with cuMemAlloc,
    half with cuMemCreate), writes 0xAB in all of them and then frees them (or its client is
    killed: the connection drops without a goodbye); the next tenant, placed on the same bytes
    of the memory file, reads zeros."""
    memfile = tmp_path / "gpu0.mem"
    size = QUOTA // 2
    a = session(tmp_path, memory_file=memfile)
    p = a.alloc(size)
    assert p.result == 0
    fill(a, p.dptr, size)
    vp = vmm_mapped(a, handle(H_VMM, 1), size)
    fill(a, vp, size)
    assert a.alloc(1).result == OOM  # it holds all it can get
    if end == "free":
        a.post(gp.MemFree(dptr=p.dptr, stream=0))
        a.post(gp.VmmUnmap(ptr=vp, size=size))
        a.post(gp.VmmRelease(handle=handle(H_VMM, 1)))
        assert a.sync() == 0
        close(a)
    else:
        a.sock.close()  # what the client's SIGKILL does to the connection
        assert a.wait() == 0, a.stderr_text()
        clean(a)

    b = session(tmp_path, memory_file=memfile)
    q = b.alloc(size)
    assert q.result == 0
    assert q.dptr == p.dptr  # the same addresses, hence the same bytes of the memory file
    assert leftovers(b, q.dptr, size) == 0
    vq = vmm_mapped(b, handle(H_VMM, 1), size)
    assert leftovers(b, vq, size) == 0
    close(b)


@pytest.mark.san  # scripts/test.sh runs it against the sanitizer build too
def test_whole_gpu_leaves_memory_to_the_scrub(tmp_path: Path) -> None:
    """Without a quota (a whole GPU) the worker does not zero: the daemon's scrub does, between
    leases. This is also what the zeroing test above would see without worker/quota.c."""
    memfile = tmp_path / "gpu0.mem"
    env = {"GPUPOOL_SIM_MEMORY_FILE": str(memfile)}
    a = WorkerSession(tmp_path / "cache", env=env)
    p = a.alloc(8 * MiB)
    fill(a, p.dptr, 8 * MiB)
    a.post(gp.MemFree(dptr=p.dptr, stream=0))
    close(a)
    b = WorkerSession(tmp_path / "cache", env=env)
    q = b.alloc(8 * MiB)
    assert q.dptr == p.dptr
    rc, data = b.dtoh(q.dptr, 8 * MiB)
    assert rc == 0 and data.count(0xAB) == 8 * MiB
    close(b)


def test_through_gpupoold_with_gpupool_memory(gpupool_server) -> None:  # type: ignore[no-untyped-def]
    """End to end: GPUPOOL_MEMORY in the client's hello, gpupoold's memory_quota, the worker's
    quota; the driver API and PyTorch on the client see a GPU of the quota's size."""
    require(importlib.util.find_spec("torch") is not None, f"torch is not installed in {sys.executable}")
    quota = 256 * MiB
    env = gpupool_server.client_env({"GPUPOOL_MEMORY": str(quota)})
    proc = run_client([sys.executable, str(SCRIPTS / "memory_quota.py"), str(quota)], env=env, timeout=300)
    lines = proc.stdout.strip().splitlines()
    out = f"exit {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-4000:]}\n{gpupool_server.log_text()[-3000:]}"
    assert proc.returncode == 0 and lines and lines[-1].startswith("PASS memory_quota"), out
    assert "memory quota 256 MiB" in gpupool_server.log_text(), out  # the worker's own line
    print(lines[-1])  # PASS memory_quota: N checks
