"""NVIDIA's cuda-bindings (`cuda.bindings.driver` / `nvrtc`) on device 0: a kernel compiled by
NVRTC and loaded twice, as PTX text (the driver JIT-compiles it at load) and as a cubin, launched
with cuLaunchKernel, its results copied back and checked.

    python tests/framework_scripts/cuda_python_probe.py

cuda-bindings finds every driver entry point through cuGetProcAddress, unlike the other probes.
Run natively and through gpupool by scripts/gpu-validation.sh. Prints one line per failed check,
then `PASS cuda-python: N checks` or `FAIL cuda-python: K of N checks failed` (exit 1).
"""

from __future__ import annotations

import ctypes

import numpy as np
from checks import Checks
from cuda.bindings import driver as cu
from cuda.bindings import nvrtc

c = Checks("cuda-python")
N = 1 << 16
SRC = rb"""
extern "C" __global__ void gp_scale(float *x, float a, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        x[i] = a * x[i] + 1.0f;
}
"""
state: dict[str, object] = {}


def ok(result):
    """cuda-bindings returns (error, value...): raise on an error, give back the values."""
    err, *rest = result
    if int(err) != 0:
        raise RuntimeError(f"{err!r}")
    return rest[0] if len(rest) == 1 else tuple(rest)


def compile_to(kind: str, arch: bytes) -> bytes:
    prog = ok(nvrtc.nvrtcCreateProgram(SRC, b"gp_scale.cu", 0, [], []))
    try:
        opts = [b"--gpu-architecture=" + arch]
        err = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0]
        if int(err) != 0:
            size = ok(nvrtc.nvrtcGetProgramLogSize(prog))
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC: {err!r}: {log.decode(errors='replace')}")
        if kind == "ptx":
            size = ok(nvrtc.nvrtcGetPTXSize(prog))
            buf = b" " * size
            ok(nvrtc.nvrtcGetPTX(prog, buf))
        else:
            size = ok(nvrtc.nvrtcGetCUBINSize(prog))
            buf = b" " * size
            ok(nvrtc.nvrtcGetCUBIN(prog, buf))
        return buf
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def context() -> None:
    ok(cu.cuInit(0))
    dev = ok(cu.cuDeviceGet(0))
    name = ok(cu.cuDeviceGetName(256, dev))
    major = ok(cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev))
    minor = ok(cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev))
    label = name.split(b"\0")[0].decode()
    print(f"  device 0: {label}, compute capability {major}.{minor}")
    state["ctx"] = ok(cu.cuDevicePrimaryCtxRetain(dev))
    ok(cu.cuCtxSetCurrent(state["ctx"]))
    state["arch"] = f"{major}{minor}".encode()
    c.check(major >= 1, "no compute capability")


def run_image(image: bytes, what: str) -> None:
    mod = ok(cu.cuModuleLoadData(image))
    fn = ok(cu.cuModuleGetFunction(mod, b"gp_scale"))
    host = np.arange(N, dtype=np.float32)
    dptr = ok(cu.cuMemAlloc(host.nbytes))
    ok(cu.cuMemcpyHtoD(dptr, host.ctypes.data, host.nbytes))
    ptr = np.array([int(dptr)], dtype=np.uint64)
    a = np.array([3.0], dtype=np.float32)
    n = np.array([N], dtype=np.int32)
    args = np.array([arg.ctypes.data for arg in (ptr, a, n)], dtype=np.uint64)
    ok(cu.cuLaunchKernel(fn, (N + 255) // 256, 1, 1, 256, 1, 1, 0, 0, args.ctypes.data, 0))
    ok(cu.cuCtxSynchronize())
    out = np.empty_like(host)
    ok(cu.cuMemcpyDtoH(out.ctypes.data, dptr, out.nbytes))
    c.check(np.array_equal(out, 3.0 * host + 1.0), f"the kernel loaded as {what} gave wrong results")
    ok(cu.cuMemFree(dptr))
    ok(cu.cuModuleUnload(mod))


def ptx() -> None:
    text = compile_to("ptx", b"compute_" + state["arch"])
    c.check(b".entry gp_scale" in text, "NVRTC's PTX has no gp_scale entry")
    run_image(text.rstrip(b"\0") + b"\0", "PTX")


def cubin() -> None:
    run_image(compile_to("cubin", b"sm_" + state["arch"]), "cubin")


def errors() -> None:
    err = cu.cuModuleLoadData(b"this is not a GPU image\0")[0]
    c.check(int(err) != 0, "loading garbage as a module succeeded")
    err = cu.cuMemAlloc(1 << 60)[0]
    c.check(err == cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY, f"allocating 1 EiB gave {err!r}")


ctypes.CDLL("libcuda.so.1")  # the one LD_LIBRARY_PATH finds first: gpupool's shim when remote
for part in (context, ptx, cubin, errors):
    c.section(part)
c.finish()
