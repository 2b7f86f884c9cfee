"""numba-cuda on device 0: `@cuda.jit` kernels (numba compiles Python to PTX with NVVM and hands
it to the driver), device arrays, shared memory and an atomic, checked against NumPy.

    python tests/framework_scripts/numba_probe.py

Run natively and through gpupool by scripts/gpu-validation.sh. Prints one line per failed check,
then `PASS numba: N checks` or `FAIL numba: K of N checks failed` (exit 1).
"""

from __future__ import annotations

import numpy as np
from checks import Checks
from numba import cuda, float32, int32

c = Checks("numba")
N = 1 << 20


@cuda.jit
def axpy(a, x, y, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = a * x[i] + y[i]


@cuda.jit
def block_sums(x, out, total):
    buf = cuda.shared.array(256, dtype=float32)
    t = cuda.threadIdx.x
    i = cuda.grid(1)
    buf[t] = x[i] if i < x.size else float32(0)
    cuda.syncthreads()
    step = 128
    while step > 0:
        if t < step:
            buf[t] += buf[t + step]
        cuda.syncthreads()
        step //= 2
    if t == 0:
        out[cuda.blockIdx.x] = buf[0]
        cuda.atomic.add(total, 0, int32(1))


def device() -> None:
    dev = cuda.get_current_device()
    print(f"  numba device: {dev.name}, compute capability {dev.compute_capability}")
    c.check(cuda.is_available(), "cuda.is_available() is False")


def kernel() -> None:
    x = np.arange(N, dtype=np.float32)
    y = np.ones(N, dtype=np.float32)
    dx, dy = cuda.to_device(x), cuda.to_device(y)
    dout = cuda.device_array_like(x)
    axpy[(N + 255) // 256, 256](np.float32(2.0), dx, dy, dout)
    c.check(np.array_equal(dout.copy_to_host(), 2.0 * x + 1.0), "axpy kernel differs from NumPy")


def shared_and_atomic() -> None:
    x = np.random.default_rng(8).standard_normal(N).astype(np.float32)
    blocks = N // 256
    out = cuda.device_array(blocks, dtype=np.float32)
    total = cuda.to_device(np.zeros(1, dtype=np.int32))
    block_sums[blocks, 256](cuda.to_device(x), out, total)
    cuda.synchronize()
    want = x.reshape(blocks, 256).sum(axis=1)
    c.check(np.allclose(out.copy_to_host(), want, rtol=1e-4, atol=1e-4), "per-block sums differ")
    c.check(int(total.copy_to_host()[0]) == blocks, "the atomic counter missed blocks")


for part in (device, kernel, shared_and_atomic):
    c.section(part)
c.finish()
