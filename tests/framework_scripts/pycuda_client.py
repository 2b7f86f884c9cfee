"""A CUDA program written with pycuda, as its users write them: devices, contexts, allocation,
copies in every direction, pinned memory, streams, events, SourceModule kernels (nvcc), prepared
calls, module globals, gpuarray transfers and pycuda's exceptions; every result checked.

    python tests/framework_scripts/pycuda_client.py

The kernels are the simulated device's test kernels (tests/sim/gp_test_kernels.cuh), so the
program passes on the simulated device and on a real GPU alike; the one kernel the simulator does
not carry must fail there with "not supported" and run on a real GPU. pycuda's own gpuarray
arithmetic compiles kernels of its own, which only a real GPU runs: this program uses gpuarray
for transfers only. Run through gpupool by tests/test_e2e_python_clients.py; prints one line per
failed check, then `PASS pycuda: N checks` or `FAIL pycuda: K of N checks failed` (exit 1).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pycuda.driver as cuda
from checks import Checks
from pycuda import gpuarray
from pycuda.compiler import SourceModule

KERNELS = Path(__file__).resolve().parents[1] / "sim"
SOURCE = """
#include "gp_test_kernels.cuh"
extern "C" __global__ void not_simulated(float *x) { x[threadIdx.x] += 1.0f; }
__device__ int gp_counters[4] = {7, 8, 9, 10};
"""
N = 1 << 16
MIB = 1 << 20

c = Checks("pycuda")
state: dict = {}


def devices() -> None:
    cuda.init()
    count = cuda.Device.count()
    c.check(count >= 1, f"Device.count() gave {count}")
    dev = cuda.Device(0)
    major, minor = dev.compute_capability()
    name = dev.name()
    state["simulated"] = "simulated" in name.lower()
    sms = dev.get_attribute(cuda.device_attribute.MULTIPROCESSOR_COUNT)
    print(f"  device 0: {name}, compute capability {major}.{minor}, {sms} SMs, "
          f"{dev.total_memory() / (1 << 30):.0f} GiB; driver {cuda.get_driver_version()}")
    c.check(major >= 5 and sms >= 1 and dev.total_memory() >= MIB, "implausible device attributes")
    c.check(len(dev.pci_bus_id()) > 0, "no PCI bus id")
    attrs = dev.get_attributes()
    c.check(attrs[cuda.device_attribute.WARP_SIZE] == 32, "warp size is not 32")
    try:
        cuda.Device(count + 100)
        c.check(False, "Device() of a device that does not exist succeeded")
    except cuda.LogicError as exc:
        c.check("invalid device" in str(exc), f"Device() of no device raised {exc}")


def contexts() -> None:
    dev = cuda.Device(0)
    ctx = dev.retain_primary_context()
    ctx.push()
    state["ctx"] = ctx
    c.check(cuda.Context.get_device() == dev, "the current context's device")
    free, total = cuda.mem_get_info()
    c.check(0 < free <= total, f"mem_get_info gave {free} of {total}")
    # A context of its own, made current, used, popped and detached.
    other = dev.make_context()
    buf = cuda.mem_alloc(MIB)
    cuda.memset_d32(buf, 0x01020304, MIB // 4)
    out = np.empty(MIB // 4, dtype=np.uint32)
    cuda.memcpy_dtoh(out, buf)
    c.check(bool((out == 0x01020304).all()), "memset in a created context read back wrong")
    buf.free()
    cuda.Context.pop()
    other.detach()
    c.check(cuda.Context.get_current() == ctx, "after pop, the primary context is not current")


def copies() -> None:
    host = np.random.default_rng(3).integers(0, 1 << 31, size=MIB, dtype=np.uint32)
    a, b = cuda.mem_alloc(host.nbytes), cuda.mem_alloc(host.nbytes)
    cuda.memcpy_htod(a, host)
    cuda.memcpy_dtod(b, a, host.nbytes)
    back = np.empty_like(host)
    cuda.memcpy_dtoh(back, b)
    c.check(np.array_equal(back, host), "host -> device -> device -> host changed the data")
    # A 2D copy of a sub-rectangle (the pitch of a row differs on both sides).
    rows, cols = 64, 256
    pitched, pitch = cuda.mem_alloc_pitch(cols * 4, rows, 4)
    grid = host[: rows * cols].reshape(rows, cols)
    up = cuda.Memcpy2D()
    up.set_src_host(grid)
    up.set_dst_device(pitched)
    up.src_pitch, up.dst_pitch, up.width_in_bytes, up.height = cols * 4, pitch, cols * 4, rows
    up(aligned=True)
    down = cuda.Memcpy2D()
    down.set_src_device(pitched)
    half = np.zeros((rows, cols // 2), dtype=np.uint32)
    down.set_dst_host(half)
    down.src_x_in_bytes = cols * 2
    down.src_pitch, down.dst_pitch, down.width_in_bytes, down.height = pitch, cols * 2, cols * 2, rows
    down(aligned=True)
    c.check(np.array_equal(half, grid[:, cols // 2:]), "Memcpy2D of the right half of a matrix")
    pitched.free()
    # Pinned memory and async copies on a stream.
    stream = cuda.Stream()
    pinned = cuda.pagelocked_empty(host.shape, host.dtype)
    pinned[:] = host[::-1]
    cuda.memcpy_htod_async(a, pinned, stream)
    cuda.memset_d8_async(b, 0xAB, host.nbytes, stream)
    cuda.memcpy_dtod_async(b, a, host.nbytes // 2, stream)
    pinned[:] = 0
    cuda.memcpy_dtoh_async(pinned, b, stream)
    stream.synchronize()
    c.check(stream.is_done(), "a synchronised stream is not done")
    n = host.size // 2
    c.check(np.array_equal(pinned[:n], host[::-1][:n]), "async copies: first half")
    c.check(bool((pinned[n:] == 0xABABABAB).all()), "async memset: second half")
    # gpuarray, for transfers.
    g = gpuarray.to_gpu(host)
    c.check(np.array_equal(g.get(), host), "gpuarray.to_gpu(...).get()")
    c.check(g.shape == host.shape and g.dtype == host.dtype, "gpuarray's shape and dtype")
    g.gpudata.free()
    a.free()
    b.free()


def modules() -> None:
    with tempfile.TemporaryDirectory() as cache:
        mod = SourceModule(SOURCE, no_extern_c=True, include_dirs=[str(KERNELS)], cache_dir=cache)
    state["mod"] = mod
    axpy = mod.get_function("gp_test_axpy")
    x = np.arange(N, dtype=np.float32)
    y = np.full(N, 2.0, dtype=np.float32)
    want = 3.0 * x + y
    # pycuda's argument handlers: copy in, run, copy out.
    axpy(np.float32(3.0), cuda.In(x), cuda.InOut(y), np.int32(N), block=(256, 1, 1),
         grid=((N + 255) // 256, 1))
    c.check(np.array_equal(y, want), "gp_test_axpy with cuda.In/InOut gave wrong results")
    # A prepared call on a stream, with device pointers.
    dx, dy = cuda.to_device(x), cuda.to_device(np.ones(N, dtype=np.float32))
    axpy.prepare("fPPi")
    stream = cuda.Stream()
    axpy.prepared_async_call(((N + 127) // 128, 1), (128, 1, 1), stream, 0.5, dx, dy, N)
    stream.synchronize()
    c.check(np.array_equal(cuda.from_device(dy, (N,), np.float32), 0.5 * x + 1.0),
            "a prepared async call of gp_test_axpy")
    # Every scalar size, as numpy scalars.
    out = cuda.mem_alloc(6 * 8)
    mod.get_function("gp_test_scalars")(out, np.int8(-5), np.int16(-300), np.int32(70000),
                                        np.int64(1 << 40), np.float32(1.5), np.float64(2.25),
                                        block=(1, 1, 1))
    got = cuda.from_device(out, (6,), np.float64)
    c.check(got.tolist() == [-5, -300, 70000, 1 << 40, 1.5, 2.25], f"gp_test_scalars: {got}")
    # A 400-byte struct by value (a numpy structured scalar).
    arg = np.zeros((), dtype=[("v", np.int32, 100)])
    arg["v"] = np.arange(1, 101)
    res = np.zeros(3, dtype=np.int64)
    mod.get_function("gp_test_big_struct")(arg[()], cuda.Out(res), block=(1, 1, 1))
    want_sum = sum(j * j for j in range(1, 101))  # v[k] = k + 1, weighted by k + 1
    c.check(res.tolist() == [want_sum, 1, 100], f"gp_test_big_struct gave {res.tolist()}")
    # A 3D grid of 3D blocks.
    total = 3 * 2 * 2 * 8 * 4 * 2
    idx = np.zeros(total, dtype=np.uint32)
    mod.get_function("gp_test_index")(cuda.Out(idx), np.uint32(total), block=(8, 4, 2),
                                      grid=(3, 2, 2))
    want_idx = (np.arange(total, dtype=np.uint64) * 2654435761 % (1 << 32)).astype(np.uint32)
    c.check(np.array_equal(idx, want_idx), "gp_test_index over a 3D grid")
    regs = axpy.get_attribute(cuda.function_attribute.NUM_REGS)
    c.check(regs > 0, f"NUM_REGS of gp_test_axpy is {regs}")
    for p in (dx, dy, out):
        p.free()


def globals_and_timing() -> None:
    mod = state["mod"]
    ptr, size = mod.get_global("gp_counters")
    c.check(size == 16, f"gp_counters is {size} bytes")
    vals = np.empty(4, dtype=np.int32)
    cuda.memcpy_dtoh(vals, ptr)
    c.check(vals.tolist() == [7, 8, 9, 10], f"a global's initial value read {vals.tolist()}")
    cuda.memcpy_htod(ptr, np.array([1, 2, 3, 4], dtype=np.int32))
    cuda.memcpy_dtoh(vals, ptr)
    c.check(vals.tolist() == [1, 2, 3, 4], "a global written and read back")
    # Events around a 20 ms kernel.
    spin = mod.get_function("gp_test_spin")
    stream = cuda.Stream()
    start, end = cuda.Event(), cuda.Event()
    start.record(stream)
    spin(np.uint64(20_000_000), block=(1, 1, 1), stream=stream)
    end.record(stream)
    end.synchronize()
    ms = start.time_till(end)
    c.check(15.0 <= ms < 5000.0, f"a 20 ms kernel timed {ms:.2f} ms between events")
    c.check(end.query(), "a finished event is not done")
    other = cuda.Stream()
    other.wait_for_event(end)
    other.synchronize()


def errors() -> None:
    try:
        cuda.mem_alloc(1 << 60)
        c.check(False, "allocating 1 EiB succeeded")
    except cuda.MemoryError as exc:
        c.check("out of memory" in str(exc), f"allocating 1 EiB raised {exc}")
    try:
        state["mod"].get_function("no_such_kernel")
        c.check(False, "get_function of a kernel that is not there succeeded")
    except cuda.LogicError as exc:
        c.check("not found" in str(exc), f"get_function of no kernel raised {exc}")
    try:
        cuda.module_from_buffer(b"this is not a GPU image\0")
        c.check(False, "loading garbage as a module succeeded")
    except cuda.Error as exc:
        c.check("invalid" in str(exc).lower(), f"loading garbage raised {exc}")
    # The kernel the simulated device does not carry: refused there, runs on a real GPU.
    x = np.zeros(32, dtype=np.float32)
    try:
        state["mod"].get_function("not_simulated")(cuda.InOut(x), block=(32, 1, 1))
        c.check(not state["simulated"], "an unsimulated kernel ran on the simulated device")
        c.check(bool((x == 1.0).all()), "not_simulated gave wrong results on a real GPU")
    except cuda.Error as exc:
        c.check(state["simulated"] and "not supported" in str(exc),
                f"not_simulated raised {exc}")
    # None of those errors is sticky: the context still works.
    buf = cuda.mem_alloc(4096)
    cuda.memset_d8(buf, 1, 4096)
    buf.free()
    cuda.Context.synchronize()
    cuda.Context.pop()
    state["ctx"].detach()


for part in (devices, contexts, copies, modules, globals_and_timing, errors):
    c.section(part)
c.finish()
