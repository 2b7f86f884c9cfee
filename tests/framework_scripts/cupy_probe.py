"""CuPy on device 0: kernels it compiles at run time with NVRTC (elementwise, reduction, a raw
kernel from source, the same kernel loaded as PTX text), and its libraries (cuBLAS matmul, cuFFT,
cuRAND, CUB sort and sums). Every result is checked against NumPy on the host.

    python tests/framework_scripts/cupy_probe.py

Run natively and through gpupool by scripts/gpu-validation.sh. Prints one line per failed check,
then `PASS cupy: N checks` or `FAIL cupy: K of N checks failed` (exit 1).
"""

from __future__ import annotations

import cupy as cp
import numpy as np
from checks import Checks

c = Checks("cupy")
N = 1 << 20

SAXPY = r"""
extern "C" __global__ void gp_saxpy(const float *x, const float *y, float *out, float a, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        out[i] = a * x[i] + y[i];
}
"""


def device() -> None:
    cp.cuda.Device(0).use()
    props = cp.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    print(f"  device 0: {name}, cupy {cp.__version__}, CUDA runtime {cp.cuda.runtime.runtimeGetVersion()}")
    c.check(props["totalGlobalMem"] > 0, "device 0 reports no memory")


def elementwise() -> None:
    k = cp.ElementwiseKernel("float32 x, float32 a", "float32 y", "y = a * x + 1.0f", "gp_affine")
    x = cp.arange(N, dtype=cp.float32)
    got = cp.asnumpy(k(x, cp.float32(2.0)))
    want = 2.0 * np.arange(N, dtype=np.float32) + 1.0
    c.check(np.array_equal(got, want), "ElementwiseKernel a*x+1 differs from NumPy")
    got2 = cp.asnumpy(cp.sin(x[:4096]) ** 2 + cp.cos(x[:4096]) ** 2)
    c.check(np.allclose(got2, 1.0, atol=1e-5), "sin^2 + cos^2 is not 1")


def reduction() -> None:
    k = cp.ReductionKernel("T x", "T y", "x * x", "a + b", "y = a", "0", "gp_sumsq")
    h = np.random.default_rng(1).standard_normal(N).astype(np.float64)
    d = cp.asarray(h)
    c.check(np.isclose(float(k(d)), float(np.sum(h * h)), rtol=1e-9), "ReductionKernel sum of squares")
    c.check(np.isclose(float(cp.sum(d)), float(np.sum(h)), rtol=1e-9, atol=1e-6), "cp.sum")
    c.check(float(cp.max(d)) == float(np.max(h)), "cp.max")
    c.check(int(cp.argmin(d)) == int(np.argmin(h)), "cp.argmin")


def raw_kernel() -> None:
    kern = cp.RawKernel(SAXPY, "gp_saxpy")
    x = cp.arange(N, dtype=cp.float32)
    y = cp.ones(N, dtype=cp.float32)
    out = cp.empty_like(x)
    kern(((N + 255) // 256,), (256,), (x, y, out, cp.float32(3.0), cp.int32(N)))
    want = 3.0 * np.arange(N, dtype=np.float32) + 1.0
    c.check(np.array_equal(cp.asnumpy(out), want), "RawKernel saxpy differs from NumPy")


def ptx_module() -> None:
    """The same kernel as PTX text (NVRTC, no cubin): the driver JIT-compiles it at load."""
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(SAXPY, "gp_saxpy.cu", [], [])
    try:
        nvrtc.compileProgram(prog, ["--gpu-architecture=compute_90"])
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    text = ptx if isinstance(ptx, bytes) else ptx.encode()
    c.check(b".entry gp_saxpy" in text, "NVRTC's PTX has no gp_saxpy entry")
    mod = cp.cuda.function.Module()
    mod.load(text.rstrip(b"\0") + b"\0")
    fn = mod.get_function("gp_saxpy")
    x = cp.arange(N, dtype=cp.float32)
    y = cp.full(N, 2.0, dtype=cp.float32)
    out = cp.empty_like(x)
    fn(((N + 255) // 256,), (256,), (x, y, out, cp.float32(0.5), cp.int32(N)))
    want = 0.5 * np.arange(N, dtype=np.float32) + 2.0
    c.check(np.array_equal(cp.asnumpy(out), want), "the kernel loaded as PTX differs from NumPy")


def matmul() -> None:
    rng = np.random.default_rng(2)
    a = rng.standard_normal((512, 384)).astype(np.float32)
    b = rng.standard_normal((384, 256)).astype(np.float32)
    got = cp.asnumpy(cp.asarray(a) @ cp.asarray(b))
    c.check(np.allclose(got, a @ b, rtol=1e-3, atol=1e-3), "cuBLAS float32 matmul differs from NumPy")
    a64 = a.astype(np.float64)
    got64 = cp.asnumpy(cp.asarray(a64) @ cp.asarray(a64.T))
    c.check(np.allclose(got64, a64 @ a64.T, rtol=1e-10), "cuBLAS float64 matmul differs from NumPy")


def fft() -> None:
    h = np.random.default_rng(3).standard_normal(1 << 16) + 0j
    got = cp.asnumpy(cp.fft.fft(cp.asarray(h)))
    c.check(np.allclose(got, np.fft.fft(h), rtol=1e-9, atol=1e-8), "cuFFT differs from NumPy")
    back = cp.asnumpy(cp.fft.ifft(cp.fft.fft(cp.asarray(h))))
    c.check(np.allclose(back, h, atol=1e-10), "ifft(fft(x)) != x")


def random() -> None:
    rs = cp.random.RandomState(seed=7)
    u = cp.asnumpy(rs.uniform(size=N, dtype=cp.float32))
    c.check(bool(((u >= 0) & (u < 1)).all()), "uniform outside [0, 1)")
    c.check(abs(float(u.mean()) - 0.5) < 0.01, f"uniform mean {u.mean()}")
    n = cp.asnumpy(rs.standard_normal(size=N, dtype=cp.float64))
    c.check(abs(float(n.mean())) < 0.01 and abs(float(n.std()) - 1) < 0.01,
            f"normal mean {n.mean()} std {n.std()}")
    again = cp.asnumpy(cp.random.RandomState(seed=7).uniform(size=N, dtype=cp.float32))
    c.check(np.array_equal(u, again), "the same seed gave different numbers")


def sort() -> None:
    h = np.random.default_rng(4).integers(-(1 << 30), 1 << 30, size=N, dtype=np.int64)
    d = cp.asarray(h)
    c.check(np.array_equal(cp.asnumpy(cp.sort(d)), np.sort(h)), "cp.sort differs from NumPy")
    c.check(np.array_equal(cp.asnumpy(cp.cumsum(d[:4096])), np.cumsum(h[:4096])), "cp.cumsum")
    idx = cp.asnumpy(cp.argsort(d[:65536]))
    c.check(np.array_equal(h[:65536][idx], np.sort(h[:65536])), "cp.argsort does not sort")


for part in (device, elementwise, reduction, raw_kernel, ptx_module, matmul, fft, random, sort):
    c.section(part)
cp.cuda.Device(0).synchronize()
c.finish()
