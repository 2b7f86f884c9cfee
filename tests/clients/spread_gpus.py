"""spread_gpus: a program of N GPUs on the driver API through ctypes, for a lease whose GPUs may
come from several servers (issue 37, item 3: tests/test_e2e_spread.py).

    GPUPOOL_GPUS=N GPUPOOL_SPREAD=1 python spread_gpus.py N BYTES [hold]

Loads libcuda.so.1 (ours, first on LD_LIBRARY_PATH), checks that it sees N devices, puts BYTES
of different random bytes on each (through each device's primary context) and checks that the
device ranges do not overlap and that cuPointerGetAttribute(DEVICE_ORDINAL) names each one's
device. Prints `peer I J V` for every ordered pair (cuDeviceCanAccessPeer), then copies every
device's bytes to every other device (cuMemcpyPeer, read back bit-exact on the destination),
and with device 0's context current: cuCtxEnablePeerAccess to every other device (refused as
the driver refuses a device that is no peer), a stream of device 0 waiting for an event of the
last device, an async peer copy and an async read from the last device on that stream, a
device-to-device copy between the last two devices (cuMemcpyDtoD_v2, both on another server in
a spread lease) and a memset of the last device; at the end every buffer is freed with device
0's context current. With GPUPOOL_CALL_COUNTS=1 it then prints `counts {json}` (the shim's
gpupool_call_counts: frames and bytes per op). With GPUPOOL_TEST_GLOBAL_CUBIN=FILE (a cubin
with `__device__ unsigned char gp_spread_g[4096]`) it checks that a library's global has a copy
per part (`library globals per part ok`). Prints `PASS spread_gpus pairs=P` and exits 0;
otherwise `FAIL spread_gpus: ...` and exit 1.
With `hold` it prints `holding` after the copies and waits for a line on stdin (a test kills
it there, or one of its servers), then reads device 0's bytes once more and prints `after hold
NAME` (the result's name; exit 2 unless CUDA_SUCCESS).
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Any

CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9


class Failed(Exception):
    pass


INDEX_PTX = b""".version 8.0
.target sm_90
.address_size 64
.visible .entry gp_test_index(.param .u64 out, .param .u32 n)
{
    ret;
}
\0"""
INDEX_N = 256


def library_globals_per_part(cuda: ctypes.CDLL, check: Any, ctxs: list[ctypes.c_void_p],
                             cubin: bytes) -> None:
    """A library with a __device__ global (cubin: GPUPOOL_TEST_GLOBAL_CUBIN) has one copy of it
    per part: cuLibraryGetGlobal with device 0's context current and with the other part's
    first device's, each named right by cuPointerGetAttribute with its context current, each
    holding what was written to it while the other's was written too (the shim once cached the
    first part's answer by name, and its VA map held one part's copy of an address only)."""
    lib = ctypes.c_void_p()
    check("cuCtxSetCurrent", ctxs[0])
    check("cuLibraryLoadData", ctypes.byref(lib), cubin, None, None, 0, None, None, 0)
    where: dict[int, int] = {}
    for dev in sorted({0, len(ctxs) // 2}):
        check("cuCtxSetCurrent", ctxs[dev])
        ptr, size = ctypes.c_uint64(), ctypes.c_size_t()
        check("cuLibraryGetGlobal", ctypes.byref(ptr), ctypes.byref(size), lib, b"gp_spread_g")
        ordinal = ctypes.c_int(-1)
        check("cuPointerGetAttribute", ctypes.byref(ordinal),
              CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)
        if ordinal.value != dev or size.value != 4096:
            raise Failed(f"the global asked with device {dev}'s context is at 0x{ptr.value:x} "
                         f"({size.value} bytes), named device {ordinal.value}")
        where[dev] = ptr.value
        check("cuMemcpyHtoD_v2", ptr, bytes([dev + 1]) * 4096, ctypes.c_size_t(4096))
    # The addresses may be equal (each server's driver places its globals on its own: the
    # simulated device always alike); each part's copy holds its own bytes all the same.
    for dev, addr in where.items():
        check("cuCtxSetCurrent", ctxs[dev])
        back = ctypes.create_string_buffer(4096)
        check("cuMemcpyDtoH_v2", back, ctypes.c_uint64(addr), ctypes.c_size_t(4096))
        if back.raw != bytes([dev + 1]) * 4096:
            raise Failed(f"the global of device {dev}'s part does not hold what was written")
    check("cuCtxSetCurrent", ctxs[0])
    check("cuLibraryUnload", lib)
    print("library globals per part ok", flush=True)


def launch_on_every_part(cuda: ctypes.CDLL, check: Any, ctxs: list[ctypes.c_void_p],
                         dsts: list[int]) -> None:
    """A library (context-free, as cudart 12 loads every fatbin) loaded with device 0's context
    current, its kernel launched on device 0 and on the first device of the other part
    (device want // 2 of a lease spread over two servers): both results right."""
    lib, kern, func = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    check("cuCtxSetCurrent", ctxs[0])
    check("cuLibraryLoadData", ctypes.byref(lib), INDEX_PTX, None, None, 0, None, None, 0)
    check("cuLibraryGetKernel", ctypes.byref(kern), lib, b"gp_test_index")
    want = [(i * 2654435761) & 0xFFFFFFFF for i in range(INDEX_N)]
    for dev in sorted({0, len(ctxs) // 2}):
        check("cuCtxSetCurrent", ctxs[dev])
        check("cuKernelGetFunction", ctypes.byref(func), kern)
        out, count = ctypes.c_uint64(dsts[dev]), ctypes.c_uint32(INDEX_N)
        args = (ctypes.c_void_p * 2)(ctypes.addressof(out), ctypes.addressof(count))
        check("cuLaunchKernel", func, 1, 1, 1, INDEX_N, 1, 1, 0, None, args, None)
        got = (ctypes.c_uint32 * INDEX_N)()
        check("cuMemcpyDtoH_v2", got, out, ctypes.c_size_t(INDEX_N * 4))
        if list(got) != want:
            raise Failed(f"the library's kernel on device {dev} wrote the wrong values")
        print(f"kernel on device {dev} ok")
    check("cuCtxSetCurrent", ctxs[0])
    check("cuLibraryUnload", lib)
    # A module of the other part's device, named with device 0's context current: its
    # attribute and its unload go to its own part.
    other = len(ctxs) // 2
    mod, value = ctypes.c_void_p(), ctypes.c_int(-1)
    check("cuCtxSetCurrent", ctxs[other])
    check("cuModuleLoadData", ctypes.byref(mod), INDEX_PTX)
    check("cuModuleGetFunction", ctypes.byref(func), mod, b"gp_test_index")
    check("cuCtxSetCurrent", ctxs[0])
    check("cuFuncGetAttribute", ctypes.byref(value), 0, func)  # MAX_THREADS_PER_BLOCK
    if value.value <= 0:
        raise Failed(f"cuFuncGetAttribute of device {other}'s function -> {value.value}")
    check("cuModuleUnload", mod)
    check("cuCtxSetCurrent", ctxs[other])
    check("cuCtxSynchronize")  # a refused unload would be its error
    print(f"module of device {other} ok")


class MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("handle_types", ctypes.c_int),
                ("location", MemLocation), ("win32", ctypes.c_void_p),
                ("flags", ctypes.c_uint8 * 8)]


class AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", MemLocation), ("flags", ctypes.c_int)]


def vmm_on_another_part(cuda: ctypes.CDLL, check: Any, ctxs: list[ctypes.c_void_p],
                        dev: int) -> None:
    """VMM on device dev (another server than device 0's), its context made current right after
    a call in device 0's context: reserve, create, map, access, a copy in and out, unmap,
    release, free, all on dev's part (PyTorch's expandable segments after set_device); a map of
    its memory at an address reserved on device 0's part is refused (CUDA_ERROR_INVALID_VALUE)."""
    g, ptr, handle = ctypes.c_size_t(), ctypes.c_uint64(), ctypes.c_uint64()
    prop = AllocProp(type=1, location=MemLocation(type=1, id=dev))  # pinned, on device dev
    check("cuCtxSetCurrent", ctxs[0])
    check("cuCtxSynchronize")  # device 0's context the thread's last on the wire
    check("cuCtxSetCurrent", ctxs[dev])
    check("cuMemGetAllocationGranularity", ctypes.byref(g), ctypes.byref(prop), 0)
    check("cuMemAddressReserve", ctypes.byref(ptr), g, ctypes.c_size_t(0), ctypes.c_uint64(0),
          ctypes.c_ulonglong(0))
    check("cuMemCreate", ctypes.byref(handle), g, ctypes.byref(prop), ctypes.c_ulonglong(0))
    elsewhere = ctypes.c_uint64()
    check("cuCtxSetCurrent", ctxs[0])
    check("cuMemAddressReserve", ctypes.byref(elsewhere), g, ctypes.c_size_t(0),
          ctypes.c_uint64(0), ctypes.c_ulonglong(0))
    rc = cuda.cuMemMap(elsewhere, g, ctypes.c_size_t(0), handle, ctypes.c_ulonglong(0))
    if rc != 1:
        raise Failed(f"cuMemMap of device {dev}'s memory on device 0's server -> {rc}, not 1")
    check("cuMemAddressFree", elsewhere, g)
    check("cuCtxSetCurrent", ctxs[dev])
    check("cuMemMap", ptr, g, ctypes.c_size_t(0), handle, ctypes.c_ulonglong(0))
    access = AccessDesc(location=MemLocation(type=1, id=dev), flags=3)  # read-write
    check("cuMemSetAccess", ptr, g, ctypes.byref(access), ctypes.c_size_t(1))
    data = os.urandom(g.value)
    back = ctypes.create_string_buffer(g.value)
    check("cuMemcpyHtoD_v2", ptr, data, g)
    check("cuMemcpyDtoH_v2", back, ptr, g)
    if back.raw != data:
        raise Failed(f"VMM memory of device {dev} read back differs")
    check("cuMemUnmap", ptr, g)
    check("cuMemRelease", handle)
    check("cuMemAddressFree", ptr, g)
    check("cuCtxSynchronize")  # a refused map, unmap or release would be its error
    print(f"vmm on device {dev} ok")


def main() -> int:
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[attr-defined]
    want, size = int(sys.argv[1]), int(sys.argv[2])
    hold = sys.argv[3:] == ["hold"]
    cuda = ctypes.CDLL("libcuda.so.1")

    def check(name: str, *args: object) -> None:
        rc = getattr(cuda, name)(*args)
        if rc != 0:
            text = ctypes.c_char_p()
            cuda.cuGetErrorName(rc, ctypes.byref(text))
            raise Failed(f"{name} -> {(text.value or b'?').decode()} ({rc})")

    check("cuInit", 0)
    count = ctypes.c_int()
    check("cuDeviceGetCount", ctypes.byref(count))
    if count.value != want:
        raise Failed(f"{count.value} devices, not {want}")
    n = ctypes.c_size_t(size)
    ctxs, srcs, dsts, data = [], [], [], []
    for ordinal in range(want):
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        src, dst = ctypes.c_uint64(), ctypes.c_uint64()
        check("cuDeviceGet", ctypes.byref(dev), ordinal)
        check("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
        check("cuCtxSetCurrent", ctx)
        check("cuMemAlloc_v2", ctypes.byref(src), n)
        check("cuMemAlloc_v2", ctypes.byref(dst), n)
        mine = os.urandom(size)
        check("cuMemcpyHtoD_v2", src, ctypes.create_string_buffer(mine, size), n)
        ctxs.append(ctx)
        srcs.append(src.value)
        dsts.append(dst.value)
        data.append(mine)
    check("cuCtxSetCurrent", ctxs[0])  # the attribute names the device from the address alone
    for ordinal in range(want):
        for ptr in (srcs[ordinal], dsts[ordinal]):
            got = ctypes.c_int(-1)
            check("cuPointerGetAttribute", ctypes.byref(got),
                  CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ctypes.c_uint64(ptr))
            if got.value != ordinal:
                raise Failed(f"pointer {ptr:#x} of device {ordinal} says device {got.value}")
    ranges = sorted((p, p + size, d) for d in range(want) for p in (srcs[d], dsts[d]))
    for (_, end, d1), (start, _, d2) in zip(ranges, ranges[1:]):
        if start < end:
            raise Failed(f"device ranges overlap: device {d1} and device {d2}")
    print("ranges " + " ".join(f"{srcs[d]:#x}" for d in range(want)))
    for i in range(want):
        for j in range(want):
            if i != j:
                v = ctypes.c_int(-1)
                check("cuDeviceCanAccessPeer", ctypes.byref(v), i, j)
                print(f"peer {i} {j} {v.value}")
    back = ctypes.create_string_buffer(size)
    pairs = 0
    for i in range(want):
        for j in range(want):
            if i == j:
                continue
            check("cuMemcpyPeer", ctypes.c_uint64(dsts[j]), ctxs[j], ctypes.c_uint64(srcs[i]),
                  ctxs[i], n)
            check("cuCtxSetCurrent", ctxs[j])
            check("cuMemcpyDtoH_v2", back, ctypes.c_uint64(dsts[j]), n)
            if back.raw != data[i]:
                raise Failed(f"device {i}'s bytes copied to device {j} differ")
            pairs += 1
    # Device 0's context and the others: peer access as cuDeviceCanAccessPeer says (another
    # server's: CUDA_ERROR_PEER_ACCESS_UNSUPPORTED, 217), an event of the last device waited for
    # by device 0's stream, an async peer copy and an async read of the last device's memory.
    last = want - 1
    check("cuCtxSetCurrent", ctxs[0])
    for j in range(1, want):
        v = ctypes.c_int(-1)
        check("cuDeviceCanAccessPeer", ctypes.byref(v), 0, j)
        rc = cuda.cuCtxEnablePeerAccess(ctxs[j], 0)
        if rc != (0 if v.value else 217):
            raise Failed(f"cuCtxEnablePeerAccess from device 0 to {j} -> {rc} (peer {v.value})")
    ev, stream = ctypes.c_void_p(), ctypes.c_void_p()
    check("cuCtxSetCurrent", ctxs[last])
    check("cuEventCreate", ctypes.byref(ev), 0)
    check("cuEventRecord", ev, None)
    check("cuCtxSetCurrent", ctxs[0])
    check("cuStreamCreate", ctypes.byref(stream), 0)
    check("cuStreamWaitEvent", stream, ev, 0)
    check("cuMemcpyPeerAsync", ctypes.c_uint64(dsts[0]), ctxs[0], ctypes.c_uint64(srcs[last]),
          ctxs[last], n, stream)
    landed = ctypes.create_string_buffer(size)
    check("cuMemcpyDtoHAsync_v2", landed, ctypes.c_uint64(srcs[last]), n, stream)
    check("cuStreamSynchronize", stream)
    check("cuMemcpyDtoH_v2", back, ctypes.c_uint64(dsts[0]), n)
    if back.raw != data[last] or landed.raw != data[last]:
        raise Failed(f"device {last}'s bytes copied asynchronously in device 0's context differ")
    if want > 2:  # memory of another server freed on device 0's stream: refused, and kept
        rc = cuda.cuMemFreeAsync(ctypes.c_uint64(srcs[last]), stream)
        if rc != 1:
            raise Failed(f"cuMemFreeAsync of device {last}'s memory on device 0's stream -> {rc}")
        # In a capture, a wait for another server's event cannot be a graph's dependency: the
        # capture is refused and invalidated (900, then 901 at its end).
        graph = ctypes.c_void_p()
        check("cuStreamBeginCapture_v2", stream, 2)  # relaxed
        rc = cuda.cuStreamWaitEvent(stream, ev, 0)
        end = cuda.cuStreamEndCapture(stream, ctypes.byref(graph))
        if (rc, end) != (900, 901):
            raise Failed(f"a cross-server event wait in a capture -> {rc}, its end -> {end}")
    if want > 2:  # with device 0's context current: the last two devices' memory
        a, b = want - 2, want - 1
        check("cuCtxSetCurrent", ctxs[0])
        check("cuMemcpyDtoD_v2", ctypes.c_uint64(dsts[b]), ctypes.c_uint64(srcs[a]), n)
        check("cuMemcpyDtoH_v2", back, ctypes.c_uint64(dsts[b]), n)
        if back.raw != data[a]:
            raise Failed(f"device {a}'s bytes copied to device {b} in device 0's context differ")
        check("cuMemsetD8_v2", ctypes.c_uint64(dsts[b]), 0x5A, n)
        check("cuMemcpyDtoH_v2", back, ctypes.c_uint64(dsts[b]), n)
        if back.raw != b"\x5a" * size:
            raise Failed(f"the memset of device {b} in device 0's context did not land")
        # While a stream of device 0 captures, a synchronous copy on the legacy stream routed
        # to another server runs (the legacy stream is never in a capture), and the capture
        # ends whole.
        graph = ctypes.c_void_p()
        check("cuStreamBeginCapture_v2", stream, 2)  # relaxed
        rc = cuda.cuMemcpyDtoD_v2(ctypes.c_uint64(dsts[b]), ctypes.c_uint64(srcs[a]), n)
        end = cuda.cuStreamEndCapture(stream, ctypes.byref(graph))
        if (rc, end) != (0, 0):
            raise Failed(f"a routed copy on the legacy stream while another stream captures "
                         f"-> {rc}, the capture's end -> {end}")
        check("cuGraphDestroy", graph)
        check("cuMemcpyDtoH_v2", back, ctypes.c_uint64(dsts[b]), n)
        if back.raw != data[a]:
            raise Failed(f"the copy to device {b} during another stream's capture differs")
        # A context created and destroyed on device b leaves that server's worker with no
        # current context: a memset, a copy in and a read routed there still run (in device
        # b's primary context).
        made, dev_b = ctypes.c_void_p(), ctypes.c_int()
        check("cuDeviceGet", ctypes.byref(dev_b), b)
        check("cuCtxCreate_v2", ctypes.byref(made), 0, dev_b)
        check("cuCtxDestroy_v2", made)
        check("cuCtxSetCurrent", ctxs[0])
        check("cuMemsetD8_v2", ctypes.c_uint64(dsts[b]), 0x33, n)
        check("cuMemcpyHtoD_v2", ctypes.c_uint64(dsts[b]), b"\x44" * 4096, ctypes.c_size_t(4096))
        check("cuMemcpyDtoH_v2", back, ctypes.c_uint64(dsts[b]), n)
        if back.raw != b"\x44" * 4096 + b"\x33" * (size - 4096):
            raise Failed(f"a memset and a copy routed to device {b} with no context there")
    launch_on_every_part(cuda, check, ctxs, dsts)
    if os.environ.get("GPUPOOL_TEST_GLOBAL_CUBIN"):
        with open(os.environ["GPUPOOL_TEST_GLOBAL_CUBIN"], "rb") as f:
            library_globals_per_part(cuda, check, ctxs, f.read())
    if want > 2:
        vmm_on_another_part(cuda, check, ctxs, want - 1)
    if hold:  # then one call on device 0: `after hold` and its result's name
        print("holding", flush=True)
        sys.stdin.readline()
        rc = cuda.cuCtxSetCurrent(ctxs[0]) or cuda.cuMemcpyDtoH_v2(back, ctypes.c_uint64(
            srcs[0]), n)
        text = ctypes.c_char_p()
        cuda.cuGetErrorName(rc, ctypes.byref(text))
        print(f"after hold {(text.value or b'?').decode()}", flush=True)
        if rc != 0:
            return 2
    check("cuCtxSetCurrent", ctxs[0])  # each buffer freed on its own part, wherever we are
    for ordinal in range(want):
        check("cuMemFree_v2", ctypes.c_uint64(srcs[ordinal]))
        check("cuMemFree_v2", ctypes.c_uint64(dsts[ordinal]))
    for ordinal in range(want):  # a failed free would be the next synchronising call's error
        check("cuCtxSetCurrent", ctxs[ordinal])
        check("cuCtxSynchronize")
    if os.environ.get("GPUPOOL_CALL_COUNTS") == "1":  # what crossed this process's links
        fn = cuda.gpupool_call_counts
        fn.restype, fn.argtypes = ctypes.c_size_t, [ctypes.c_char_p, ctypes.c_size_t]
        buf = ctypes.create_string_buffer(fn(None, 0) + 1)
        fn(buf, len(buf))
        print(f"counts {buf.value.decode()}")
    print(f"PASS spread_gpus pairs={pairs}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Failed as exc:
        print(f"FAIL spread_gpus: {exc}")
        sys.exit(1)
