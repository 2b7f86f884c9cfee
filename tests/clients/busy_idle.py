"""busy_idle: a tenant with a known pattern of work, for the GPU time accounting test
(tests/test_e2e_usage.py), on cuda-python's driver API through gpupool's shim.

    python busy_idle.py BUSY_MS,IDLE_MS,BUSY_MS,... [LAUNCH_MS]

Takes the GPU (a context), then alternates phases, busy first: a busy phase launches the
simulated device's gp_test_spin kernel (it spins for real time, counted as the worker's busy
time) back to back in 100 ms launches for BUSY_MS and synchronises (with LAUNCH_MS: launches of
that length, each synchronised: tests/test_e2e_share_time.py's shares, whose workers then wait
for the next call between kernels and so send their stats while busy); an idle phase sends nothing
for IDLE_MS. Prints `busy_s=X` (the busy time it asked for) and exits 0; any CUDA error exits 1.
"""

from __future__ import annotations

import ctypes
import sys
import time

from cuda.bindings import driver as cu

SPIN_PTX = b""".version 8.0
.target sm_90
.address_size 64
.visible .entry gp_test_spin(.param .u64 ns)
{
    ret;
}
\0"""
LAUNCH_NS = 100_000_000


def ok(result: tuple) -> object:  # type: ignore[type-arg]
    err, *rest = result
    if err != cu.CUresult.CUDA_SUCCESS:
        print(f"busy_idle: CUDA error {err}", file=sys.stderr)
        sys.exit(1)
    return rest[0] if len(rest) == 1 else rest


def main() -> int:
    phases = [int(p) for p in sys.argv[1].split(",")]
    each = len(sys.argv) > 2
    launch_ns = int(sys.argv[2]) * 1_000_000 if each else LAUNCH_NS
    ok(cu.cuInit(0))
    dev = ok(cu.cuDeviceGet(0))
    ok(cu.cuCtxSetCurrent(ok(cu.cuDevicePrimaryCtxRetain(dev))))
    mod = ok(cu.cuModuleLoadData(SPIN_PTX))
    spin = ok(cu.cuModuleGetFunction(mod, b"gp_test_spin"))
    ns = ctypes.c_uint64(launch_ns)
    args = (ctypes.c_void_p * 1)(ctypes.addressof(ns))
    busy = 0
    for i, ms in enumerate(phases):
        if i % 2 == 0:
            for _ in range(ms * 1_000_000 // launch_ns):
                ok(cu.cuLaunchKernel(spin, 1, 1, 1, 1, 1, 1, 0, 0, ctypes.addressof(args), 0))
                busy += launch_ns
                if each:
                    ok(cu.cuCtxSynchronize())
            ok(cu.cuCtxSynchronize())
        else:
            time.sleep(ms / 1000)
    print(f"busy_s={busy / 1e9:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
