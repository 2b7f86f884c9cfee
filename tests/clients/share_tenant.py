"""share_tenant: a busy tenant of a shared GPU that counts its own work, for the fair time test
(tests/test_e2e_share_time.py), on cuda-python's driver API through gpupool's shim.

    python share_tenant.py STOP_FILE LAUNCH_MS SYNC_EVERY

Takes the GPU (a context), then launches the simulated device's gp_test_spin kernel (LAUNCH_MS of
the device's time each) back to back, synchronising after every SYNC_EVERY launches; after each
synchronise it prints `T N`: its CLOCK_MONOTONIC time (time.monotonic(), the clock of the test
that reads it) and the number of kernels completed by then. It stops at the first synchronise
that finds STOP_FILE, prints `done N` and exits 0; any CUDA error exits 1.
"""

from __future__ import annotations

import ctypes
import os
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


def ok(result: tuple) -> object:  # type: ignore[type-arg]
    err, *rest = result
    if err != cu.CUresult.CUDA_SUCCESS:
        print(f"share_tenant: CUDA error {err}", file=sys.stderr)
        sys.exit(1)
    return rest[0] if len(rest) == 1 else rest


def main() -> int:
    stop_file, launch_ms, sync_every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    ok(cu.cuInit(0))
    dev = ok(cu.cuDeviceGet(0))
    ok(cu.cuCtxSetCurrent(ok(cu.cuDevicePrimaryCtxRetain(dev))))
    mod = ok(cu.cuModuleLoadData(SPIN_PTX))
    spin = ok(cu.cuModuleGetFunction(mod, b"gp_test_spin"))
    ns = ctypes.c_uint64(launch_ms * 1_000_000)
    args = (ctypes.c_void_p * 1)(ctypes.addressof(ns))
    done = 0
    while not os.path.exists(stop_file):
        for _ in range(sync_every):
            ok(cu.cuLaunchKernel(spin, 1, 1, 1, 1, 1, 1, 0, 0, ctypes.addressof(args), 0))
        ok(cu.cuCtxSynchronize())
        done += sync_every
        print(f"{time.monotonic():.4f} {done}", flush=True)
    print(f"done {done}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
