"""A CUDA program written with NVIDIA's cuda-python (`cuda.bindings`), as its users write them:
devices, contexts, allocation, copies in every direction, streams, events, modules and kernel
launches, error codes; every result checked.

    python tests/framework_scripts/cuda_python_client.py --api driver    # cuda.bindings.driver
    python tests/framework_scripts/cuda_python_client.py --api runtime   # cuda.bindings.runtime

The two APIs reach libcuda.so.1 in the two ways cudart-using programs do: `driver` calls it
directly (cuda.bindings loads it with dlopen), `runtime` goes through the CUDA runtime that
cuda.bindings links statically. The kernels are the simulated device's test kernels
(tests/sim/gp_test_kernels.cuh), compiled here with NVRTC, so the same program passes on the
simulated device and on a real GPU; the one kernel the simulator does not have must fail there
with CUDA_ERROR_NOT_SUPPORTED and run on a real GPU. Run through gpupool by
tests/test_e2e_python_clients.py; prints one line per failed check, then `PASS cuda-python-API: N
checks` or `FAIL ...` (exit 1).
"""

from __future__ import annotations

import argparse
import ctypes
from pathlib import Path

import numpy as np
from checks import Checks
from cuda.bindings import driver as cu
from cuda.bindings import nvrtc
from cuda.bindings import runtime as rt

KERNELS = Path(__file__).resolve().parents[1] / "sim" / "gp_test_kernels.cuh"
# One kernel the simulated device does not carry (it runs only gp_test_*), and a global to read
# and write through the module.
EXTRA = b"""
extern "C" __global__ void not_simulated(float *x) { x[threadIdx.x] += 1.0f; }
__device__ int gp_counters[4] = {7, 8, 9, 10};
"""
N = 1 << 16
MIB = 1 << 20


def ok(result):
    """cuda.bindings returns (error, value...): raise on an error, give back the values."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"{err!r}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


def err_of(result) -> int:
    return int(result[0] if isinstance(result, tuple) else result)


def compile_kernels(arch: str, kind: str) -> bytes:
    """The test kernels (and EXTRA) compiled by NVRTC: a cubin for sm_XY or PTX for compute_XY."""
    src = KERNELS.read_bytes() + EXTRA
    prog = ok(nvrtc.nvrtcCreateProgram(src, b"gp_test_kernels.cu", 0, [], []))
    try:
        target = (b"--gpu-architecture=sm_" if kind == "cubin" else b"--gpu-architecture=compute_")
        opts = [target + arch.encode(), b"-default-device"]
        if err_of(nvrtc.nvrtcCompileProgram(prog, len(opts), opts)):
            size = ok(nvrtc.nvrtcGetProgramLogSize(prog))
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC failed: {log.decode(errors='replace')}")
        get_size, get = ((nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN) if kind == "cubin"
                         else (nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX))
        buf = b" " * ok(get_size(prog))
        ok(get(prog, buf))
        return buf
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def params(*values: np.ndarray) -> np.ndarray:
    """kernelParams: an array of pointers to each argument's bytes (keep `values` alive)."""
    return np.array([v.ctypes.data for v in values], dtype=np.uint64)


def ptr(p) -> np.ndarray:
    return np.array([int(p)], dtype=np.uint64)


class DriverClient:
    """The driver API (cuda.bindings.driver): what pycuda, Numba and CuPy sit on."""

    def __init__(self, c: Checks) -> None:
        self.c = c
        self.simulated = False
        self.arch = ""

    def devices(self) -> None:
        c = self.c
        ok(cu.cuInit(0))
        count = ok(cu.cuDeviceGetCount())
        c.check(count >= 1, f"cuDeviceGetCount gave {count}")
        dev = ok(cu.cuDeviceGet(0))
        name = ok(cu.cuDeviceGetName(256, dev)).split(b"\0")[0].decode()
        self.simulated = "simulated" in name.lower()
        attr = cu.CUdevice_attribute
        major = ok(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev))
        minor = ok(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev))
        sms = ok(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev))
        total = ok(cu.cuDeviceTotalMem(dev))
        uuid = bytes(ok(cu.cuDeviceGetUuid(dev)).bytes)
        version = ok(cu.cuDriverGetVersion())
        self.arch = f"{major}{minor}"
        print(f"  device 0: {name}, compute capability {major}.{minor}, {sms} SMs, "
              f"{total / (1 << 30):.0f} GiB, driver API {version}")
        c.check(major >= 5 and sms >= 1 and total >= MIB, "implausible device attributes")
        c.check(len(uuid) == 16 and any(uuid), f"device UUID {uuid!r}")
        c.check(version >= 12000, f"cuDriverGetVersion gave {version}")
        err = err_of(cu.cuDeviceGet(count + 100))
        c.check(err == cu.CUresult.CUDA_ERROR_INVALID_DEVICE,
                f"cuDeviceGet of a device that does not exist gave {err}")

    def contexts(self) -> None:
        c = self.c
        dev = ok(cu.cuDeviceGet(0))
        self.ctx = ok(cu.cuDevicePrimaryCtxRetain(dev))
        ok(cu.cuCtxSetCurrent(self.ctx))
        c.check(int(ok(cu.cuCtxGetCurrent())) == int(self.ctx), "the current context is not the primary")
        free, total = ok(cu.cuMemGetInfo())
        c.check(0 < free <= total, f"cuMemGetInfo gave free {free} of {total}")
        # A second context of its own: pushed, used, popped, destroyed.
        other = ok(cu.cuCtxCreate(None, 0, dev))
        c.check(int(ok(cu.cuCtxGetCurrent())) == int(other), "cuCtxCreate did not make it current")
        p = ok(cu.cuMemAlloc(MIB))
        ok(cu.cuMemsetD32(p, 0x01020304, MIB // 4))
        out = np.empty(MIB // 4, dtype=np.uint32)
        ok(cu.cuMemcpyDtoH(out.ctypes.data, p, MIB))
        c.check(bool((out == 0x01020304).all()), "memset in a created context read back wrong")
        popped = ok(cu.cuCtxPopCurrent())
        c.check(int(popped) == int(other), "cuCtxPopCurrent gave another context")
        ok(cu.cuCtxPushCurrent(other))
        ok(cu.cuMemFree(p))
        ok(cu.cuCtxPopCurrent())
        ok(cu.cuCtxDestroy(other))
        ok(cu.cuCtxSetCurrent(self.ctx))
        c.check(int(ok(cu.cuCtxGetDevice())) == int(dev), "cuCtxGetDevice gave another device")
        # No profiler is attached to this process: start and stop succeed and do nothing.
        c.check(err_of(cu.cuProfilerStart()) == 0 and err_of(cu.cuProfilerStop()) == 0,
                "cuProfilerStart/Stop")

    def copies(self) -> None:
        c = self.c
        host = np.random.default_rng(1).integers(0, 1 << 31, size=4 * MIB // 4, dtype=np.uint32)
        a = ok(cu.cuMemAlloc(host.nbytes))
        b = ok(cu.cuMemAlloc(host.nbytes))
        ok(cu.cuMemcpyHtoD(a, host.ctypes.data, host.nbytes))
        ok(cu.cuMemcpyDtoD(b, a, host.nbytes))
        back = np.empty_like(host)
        ok(cu.cuMemcpyDtoH(back.ctypes.data, b, host.nbytes))
        c.check(np.array_equal(back, host), "host -> device -> device -> host changed the data")
        # The unified cuMemcpy, and a range inside an allocation.
        ok(cu.cuMemcpy(back.ctypes.data, int(a) + 4096, 4096))
        c.check(np.array_equal(back[:1024], host[1024:2048]), "cuMemcpy of an inner range")
        base, size = ok(cu.cuMemGetAddressRange(int(a) + 100))
        c.check(int(base) == int(a) and size >= host.nbytes, "cuMemGetAddressRange")
        # Pinned host memory and async copies on a stream.
        stream = ok(cu.cuStreamCreate(0))
        pinned = ok(cu.cuMemHostAlloc(host.nbytes, 0))
        view = np.ctypeslib.as_array(ctypes.cast(pinned, ctypes.POINTER(ctypes.c_uint32)),
                                     shape=host.shape)
        view[:] = host[::-1]
        ok(cu.cuMemcpyHtoDAsync(a, pinned, host.nbytes, stream))
        ok(cu.cuMemsetD8Async(b, 0xAB, host.nbytes, stream))
        ok(cu.cuMemcpyDtoDAsync(b, a, host.nbytes // 2, stream))
        view[:] = 0
        ok(cu.cuMemcpyDtoHAsync(pinned, b, host.nbytes, stream))
        ok(cu.cuStreamSynchronize(stream))
        half = host.size // 2
        c.check(np.array_equal(view[:half], host[::-1][:half]), "async copies: first half")
        c.check(bool((view[half:] == 0xABABABAB).all()), "async memset: second half")
        ok(cu.cuMemFreeHost(pinned))
        ok(cu.cuStreamDestroy(stream))
        for p in (a, b):
            ok(cu.cuMemFree(p))

    def modules(self) -> None:
        for kind in ("cubin", "ptx"):
            image = compile_kernels(self.arch, kind)
            if kind == "ptx":
                image = image.rstrip(b"\0") + b"\0"
            mod = ok(cu.cuModuleLoadData(image))
            self.run_kernels(mod, kind)
            if kind == "cubin":
                self.mod = mod
            else:
                ok(cu.cuModuleUnload(mod))

    def run_kernels(self, mod, kind: str) -> None:
        c = self.c
        fn = ok(cu.cuModuleGetFunction(mod, b"gp_test_axpy"))
        x = np.arange(N, dtype=np.float32)
        y = np.full(N, 2.0, dtype=np.float32)
        dx, dy = ok(cu.cuMemAlloc(x.nbytes)), ok(cu.cuMemAlloc(y.nbytes))
        ok(cu.cuMemcpyHtoD(dx, x.ctypes.data, x.nbytes))
        ok(cu.cuMemcpyHtoD(dy, y.ctypes.data, y.nbytes))
        a, n, px, py = np.array([3.0], np.float32), np.array([N], np.int32), ptr(dx), ptr(dy)
        ok(cu.cuLaunchKernel(fn, (N + 255) // 256, 1, 1, 256, 1, 1, 0, 0,
                             params(a, px, py, n).ctypes.data, 0))
        ok(cu.cuCtxSynchronize())
        out = np.empty_like(y)
        ok(cu.cuMemcpyDtoH(out.ctypes.data, dy, out.nbytes))
        c.check(np.array_equal(out, 3.0 * x + 2.0), f"gp_test_axpy ({kind}) gave wrong results")
        # Every scalar size, packed as the kernel's parameter layout says.
        fn = ok(cu.cuModuleGetFunction(mod, b"gp_test_scalars"))
        scal = [np.array([v], t) for v, t in ((-5, np.int8), (-300, np.int16), (70000, np.int32),
                                              (1 << 40, np.int64), (1.5, np.float32),
                                              (2.25, np.float64))]
        ok(cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, 0, params(ptr(dx), *scal).ctypes.data, 0))
        got = np.empty(6, dtype=np.float64)
        ok(cu.cuMemcpyDtoH(got.ctypes.data, dx, got.nbytes))
        c.check(got.tolist() == [-5, -300, 70000, 1 << 40, 1.5, 2.25],
                f"gp_test_scalars ({kind}) gave {got.tolist()}")
        # A 3D grid of 3D blocks.
        fn = ok(cu.cuModuleGetFunction(mod, b"gp_test_index"))
        total = 3 * 2 * 2 * 8 * 4 * 2
        cnt = np.array([total], np.uint32)
        ok(cu.cuLaunchKernel(fn, 3, 2, 2, 8, 4, 2, 0, 0, params(ptr(dy), cnt).ctypes.data, 0))
        idx = np.empty(total, dtype=np.uint32)
        ok(cu.cuMemcpyDtoH(idx.ctypes.data, dy, idx.nbytes))
        want = (np.arange(total, dtype=np.uint64) * 2654435761 % (1 << 32)).astype(np.uint32)
        c.check(np.array_equal(idx, want), f"gp_test_index ({kind}) over a 3D grid")
        # A kernel the simulated device does not carry: a clear error there, runs on a GPU.
        fn = ok(cu.cuModuleGetFunction(mod, b"not_simulated"))
        err = err_of(cu.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, 0,
                                       params(ptr(dx)).ctypes.data, 0))
        if err == 0:
            err = err_of(cu.cuCtxSynchronize())
        if self.simulated:
            c.check(err == cu.CUresult.CUDA_ERROR_NOT_SUPPORTED,
                    f"an unsimulated kernel ({kind}) on the simulated device gave {err}")
        else:
            c.check(err == 0, f"not_simulated ({kind}) failed on a real GPU: {err}")
        for p in (dx, dy):
            ok(cu.cuMemFree(p))

    def globals_and_functions(self) -> None:
        c = self.c
        dptr, size = ok(cu.cuModuleGetGlobal(self.mod, b"gp_counters"))
        c.check(size == 16, f"gp_counters is {size} bytes")
        vals = np.empty(4, dtype=np.int32)
        ok(cu.cuMemcpyDtoH(vals.ctypes.data, dptr, 16))
        c.check(vals.tolist() == [7, 8, 9, 10], f"a global's initial value read {vals.tolist()}")
        err = err_of(cu.cuModuleGetFunction(self.mod, b"no_such_kernel"))
        c.check(err == cu.CUresult.CUDA_ERROR_NOT_FOUND, f"a kernel that is not there gave {err}")
        fn = ok(cu.cuModuleGetFunction(self.mod, b"gp_test_axpy"))
        regs = ok(cu.cuFuncGetAttribute(cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS, fn))
        c.check(regs > 0, f"CU_FUNC_ATTRIBUTE_NUM_REGS gave {regs}")

    def events(self) -> None:
        c = self.c
        fn = ok(cu.cuModuleGetFunction(self.mod, b"gp_test_spin"))
        stream = ok(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
        start, end = ok(cu.cuEventCreate(0)), ok(cu.cuEventCreate(0))
        ok(cu.cuEventRecord(start, stream))
        ns = np.array([20_000_000], np.uint64)
        ok(cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, stream, params(ns).ctypes.data, 0))
        ok(cu.cuEventRecord(end, stream))
        ok(cu.cuEventSynchronize(end))
        ms = ok(cu.cuEventElapsedTime(start, end))
        c.check(15.0 <= ms < 5000.0, f"a 20 ms kernel timed {ms:.2f} ms between events")
        c.check(err_of(cu.cuEventQuery(end)) == 0, "cuEventQuery of a finished event")
        other = ok(cu.cuStreamCreate(0))
        ok(cu.cuStreamWaitEvent(other, end, 0))
        ok(cu.cuStreamSynchronize(other))
        c.check(err_of(cu.cuStreamQuery(other)) == 0, "cuStreamQuery of an idle stream")
        for e in (start, end):
            ok(cu.cuEventDestroy(e))
        for s in (stream, other):
            ok(cu.cuStreamDestroy(s))

    def errors(self) -> None:
        c = self.c
        err = err_of(cu.cuMemAlloc(1 << 60))
        c.check(err == cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY, f"allocating 1 EiB gave {err}")
        name = ok(cu.cuGetErrorName(cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY))
        c.check(name == b"CUDA_ERROR_OUT_OF_MEMORY", f"cuGetErrorName gave {name!r}")
        err = err_of(cu.cuModuleLoadData(b"this is not a GPU image\0"))
        c.check(err in (cu.CUresult.CUDA_ERROR_INVALID_IMAGE, cu.CUresult.CUDA_ERROR_INVALID_PTX),
                f"loading garbage as a module gave {err}")
        host = np.empty(16, dtype=np.uint8)
        err = err_of(cu.cuMemcpyDtoH(host.ctypes.data, 0x10, 16))
        c.check(err == cu.CUresult.CUDA_ERROR_INVALID_VALUE, f"copying from address 0x10 gave {err}")
        # The context still works after those errors (none of them is sticky).
        p = ok(cu.cuMemAlloc(4096))
        ok(cu.cuMemFree(p))
        ok(cu.cuModuleUnload(self.mod))
        ok(cu.cuDevicePrimaryCtxRelease(ok(cu.cuDeviceGet(0))))

    def parts(self):
        return (self.devices, self.contexts, self.copies, self.modules, self.globals_and_functions,
                self.events, self.errors)


def launch(kernel, grid: int, block: int, stream, args: np.ndarray):
    """cuda.bindings.runtime has no cudaLaunchKernel (its void** arguments do not map to Python):
    its users launch a runtime cudaKernel_t with the driver's cuLaunchKernel, which takes one as
    it is (a cudaKernel_t is a CUkernel)."""
    return cu.cuLaunchKernel(cu.CUkernel(int(kernel)), grid, 1, 1, block, 1, 1, 0,
                             cu.CUstream(int(stream)), args.ctypes.data, 0)


class RuntimeClient:
    """The CUDA runtime API (cuda.bindings.runtime, with cudart linked in statically); launches
    through cuLaunchKernel as that API's users do (see launch())."""

    def __init__(self, c: Checks) -> None:
        self.c = c
        self.simulated = False

    def devices(self) -> None:
        c = self.c
        count = ok(rt.cudaGetDeviceCount())
        c.check(count >= 1, f"cudaGetDeviceCount gave {count}")
        ok(rt.cudaSetDevice(0))
        prop = ok(rt.cudaGetDeviceProperties(0))
        name = bytes(prop.name).split(b"\0")[0].decode()
        self.simulated = "simulated" in name.lower()
        self.arch = f"{prop.major}{prop.minor}"
        runtime, driver = ok(rt.cudaRuntimeGetVersion()), ok(rt.cudaDriverGetVersion())
        print(f"  device 0: {name}, compute capability {prop.major}.{prop.minor}, "
              f"{prop.totalGlobalMem / (1 << 30):.0f} GiB; runtime {runtime}, driver {driver}")
        c.check(prop.major >= 5 and prop.multiProcessorCount >= 1, "implausible properties")
        c.check(driver >= runtime // 1000 * 1000, f"driver {driver} is older than runtime {runtime}")
        err = err_of(rt.cudaSetDevice(count + 100))
        c.check(err == rt.cudaError_t.cudaErrorInvalidDevice, f"cudaSetDevice of no device: {err}")
        ok(rt.cudaSetDevice(0))

    def copies(self) -> None:
        c = self.c
        kind = rt.cudaMemcpyKind
        host = np.random.default_rng(2).integers(0, 1 << 31, size=MIB, dtype=np.uint32)
        a, b = ok(rt.cudaMalloc(host.nbytes)), ok(rt.cudaMalloc(host.nbytes))
        ok(rt.cudaMemcpy(a, host.ctypes.data, host.nbytes, kind.cudaMemcpyHostToDevice))
        ok(rt.cudaMemcpy(b, a, host.nbytes, kind.cudaMemcpyDeviceToDevice))
        back = np.empty_like(host)
        ok(rt.cudaMemcpy(back.ctypes.data, b, host.nbytes, kind.cudaMemcpyDeviceToHost))
        c.check(np.array_equal(back, host), "cudaMemcpy host -> device -> device -> host")
        ok(rt.cudaMemset(b, 0x5A, 4096))
        ok(rt.cudaMemcpy(back.ctypes.data, b, 4096, kind.cudaMemcpyDefault))
        c.check(bool((back[:1024] == 0x5A5A5A5A).all()), "cudaMemset then cudaMemcpyDefault")
        free, total = ok(rt.cudaMemGetInfo())
        c.check(0 < free <= total, f"cudaMemGetInfo gave {free} of {total}")
        stream = ok(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking))
        pinned = ok(rt.cudaMallocHost(host.nbytes))
        view = np.ctypeslib.as_array(ctypes.cast(pinned, ctypes.POINTER(ctypes.c_uint32)),
                                     shape=host.shape)
        view[:] = host[::-1]
        ok(rt.cudaMemcpyAsync(a, pinned, host.nbytes, kind.cudaMemcpyHostToDevice, stream))
        view[:] = 0
        ok(rt.cudaMemcpyAsync(pinned, a, host.nbytes, kind.cudaMemcpyDeviceToHost, stream))
        ok(rt.cudaStreamSynchronize(stream))
        c.check(np.array_equal(view, host[::-1]), "async copies through pinned memory")
        ok(rt.cudaFreeHost(pinned))
        ok(rt.cudaStreamDestroy(stream))
        for p in (a, b):
            ok(rt.cudaFree(p))

    def kernels(self) -> None:
        c = self.c
        lib = ok(rt.cudaLibraryLoadData(compile_kernels(self.arch, "cubin"), None, None, 0,
                                        None, None, 0))
        self.lib = lib
        axpy = ok(rt.cudaLibraryGetKernel(lib, b"gp_test_axpy"))
        x = np.arange(N, dtype=np.float32)
        y = np.full(N, 1.0, dtype=np.float32)
        dx, dy = ok(rt.cudaMalloc(x.nbytes)), ok(rt.cudaMalloc(y.nbytes))
        h2d = rt.cudaMemcpyKind.cudaMemcpyHostToDevice
        ok(rt.cudaMemcpy(dx, x.ctypes.data, x.nbytes, h2d))
        ok(rt.cudaMemcpy(dy, y.ctypes.data, y.nbytes, h2d))
        a, n = np.array([0.5], np.float32), np.array([N], np.int32)
        ok(launch(axpy, (N + 127) // 128, 128, 0, params(a, ptr(dx), ptr(dy), n)))
        ok(rt.cudaDeviceSynchronize())
        out = np.empty_like(y)
        ok(rt.cudaMemcpy(out.ctypes.data, dy, out.nbytes, rt.cudaMemcpyKind.cudaMemcpyDeviceToHost))
        c.check(np.array_equal(out, 0.5 * x + 1.0), "gp_test_axpy through the runtime")
        for p in (dx, dy):
            ok(rt.cudaFree(p))

    def events(self) -> None:
        c = self.c
        spin = ok(rt.cudaLibraryGetKernel(self.lib, b"gp_test_spin"))
        stream = ok(rt.cudaStreamCreate())
        start, end = ok(rt.cudaEventCreate()), ok(rt.cudaEventCreate())
        ok(rt.cudaEventRecord(start, stream))
        ns = np.array([20_000_000], np.uint64)
        ok(launch(spin, 1, 1, stream, params(ns)))
        ok(rt.cudaEventRecord(end, stream))
        ok(rt.cudaEventSynchronize(end))
        ms = ok(rt.cudaEventElapsedTime(start, end))
        c.check(15.0 <= ms < 5000.0, f"a 20 ms kernel timed {ms:.2f} ms between events")
        for e in (start, end):
            ok(rt.cudaEventDestroy(e))
        ok(rt.cudaStreamDestroy(stream))

    def errors(self) -> None:
        c = self.c
        err = err_of(rt.cudaMalloc(1 << 60))
        c.check(err == rt.cudaError_t.cudaErrorMemoryAllocation, f"cudaMalloc of 1 EiB gave {err}")
        # The runtime reports an error once: the next call succeeds.
        c.check(err_of(rt.cudaGetLastError()) == rt.cudaError_t.cudaErrorMemoryAllocation,
                "cudaGetLastError after the failed cudaMalloc")
        c.check(err_of(rt.cudaGetLastError()) == 0, "cudaGetLastError did not reset")
        text = ok(rt.cudaGetErrorString(rt.cudaError_t.cudaErrorMemoryAllocation))
        c.check(b"memory" in text, f"cudaGetErrorString gave {text!r}")
        ok(rt.cudaLibraryUnload(self.lib))
        ok(rt.cudaDeviceSynchronize())

    def parts(self):
        return (self.devices, self.copies, self.kernels, self.events, self.errors)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--api", choices=("driver", "runtime"), default="driver")
    args = ap.parse_args()
    c = Checks(f"cuda-python-{args.api}")
    client = DriverClient(c) if args.api == "driver" else RuntimeClient(c)
    for part in client.parts():
        c.section(part)
    c.finish()


if __name__ == "__main__":
    main()
