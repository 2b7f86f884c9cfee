#!/usr/bin/env python3
"""A client program whose calls are known, for the link model's counts (tests/test_link_model.py).

    known_calls.py STEPS [--unknown-kernel]

Through the driver API of whichever libcuda.so.1 comes first (ctypes; the test puts the shim
there, with GPUPOOL_CALL_COUNTS=1): set-up (context, a PTX module, two device buffers, a stream,
pinned host memory), then bench/link_model.py's read_counts(), then STEPS steps of exactly:

    4 x cuLaunchKernel(gp_test_axpy, kernelParams)    launch, not waited for
    3 x cuLaunchKernel(gp_test_noop)                  launch
    1 x cuMemcpyHtoD_v2, HTOD_SYNC bytes              memcpy_htod, not waited for
    1 x cuMemcpyHtoDAsync_v2, HTOD_ASYNC bytes        memcpy_htod, not waited for
    1 x cuMemcpyDtoHAsync_v2, DTOH_ASYNC bytes        memcpy_dtoh, answered later (detached)
    1 x cuMemcpyDtoH_v2, DTOH_SYNC bytes              memcpy_dtoh, a round trip
    1 x cuStreamSynchronize                           stream_synchronize, a round trip
  with --unknown-kernel also
    1 x cuLaunchKernel(my_real_kernel)                launch (only a count-mode device accepts it)

then read_counts() again and prints one JSON line: {"steps", "device" (its name), "before",
"after", "diff"}. On the
simulated device (not in count mode) it also checks that gp_test_axpy computed.
"""

from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import link_model  # noqa: E402 - bench/ is not a package

HTOD_SYNC, HTOD_ASYNC, DTOH_ASYNC, DTOH_SYNC = 3000, 4096, 1024, 2048
N = 1024  # floats per buffer
PTX = b".version 9.0\n.target sm_90\n.address_size 64\n.visible .entry gp_test_noop()\n{\n\tret;\n}\n"
KERNEL_LAUNCHES = {"gp_test_axpy": 4, "gp_test_noop": 3}

cuda = ctypes.CDLL("libcuda.so.1")


def ok(name: str, *args: object) -> None:
    rc = getattr(cuda, name)(*args)
    if rc != 0:
        raise SystemExit(f"known_calls: {name} failed with CUresult {rc}")


def main() -> int:
    steps = int(sys.argv[1])
    unknown = "--unknown-kernel" in sys.argv[2:]
    p = ctypes.c_void_p
    ok("cuInit", 0)
    dev = ctypes.c_int()
    ok("cuDeviceGet", ctypes.byref(dev), 0)
    ctx = p()
    ok("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
    ok("cuCtxSetCurrent", ctx)
    mod = p()
    ok("cuModuleLoadData", ctypes.byref(mod), ctypes.c_char_p(PTX))
    funcs = {}
    for name in [*KERNEL_LAUNCHES, "my_real_kernel"]:
        funcs[name] = p()
        ok("cuModuleGetFunction", ctypes.byref(funcs[name]), mod, name.encode())
    dx, dy, dz = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_uint64()
    for buf in (dx, dy, dz):
        ok("cuMemAlloc_v2", ctypes.byref(buf), ctypes.c_size_t(N * 4))
    stream = p()
    ok("cuStreamCreate", ctypes.byref(stream), 0)
    pinned = p()
    ok("cuMemHostAlloc", ctypes.byref(pinned), ctypes.c_size_t(DTOH_ASYNC), 0)
    xs = (ctypes.c_float * N)(*[float(i) for i in range(N)])
    ok("cuMemcpyHtoD_v2", dx, xs, ctypes.c_size_t(N * 4))
    ok("cuMemcpyHtoD_v2", dy, (ctypes.c_float * N)(), ctypes.c_size_t(N * 4))
    src = (ctypes.c_char * HTOD_ASYNC)()
    back = (ctypes.c_char * DTOH_SYNC)()
    a, n = ctypes.c_float(1.0), ctypes.c_int(N)
    params = (p * 4)(*[ctypes.cast(ctypes.byref(v), p) for v in (a, dx, dy, n)])
    ok("cuStreamSynchronize", stream)

    before = link_model.read_counts()
    for _ in range(steps):
        for _ in range(KERNEL_LAUNCHES["gp_test_axpy"]):
            ok("cuLaunchKernel", funcs["gp_test_axpy"], 4, 1, 1, 256, 1, 1, 0, stream, params, None)
        for _ in range(KERNEL_LAUNCHES["gp_test_noop"]):
            ok("cuLaunchKernel", funcs["gp_test_noop"], 1, 1, 1, 1, 1, 1, 0, stream, None, None)
        if unknown:
            ok("cuLaunchKernel", funcs["my_real_kernel"], 1, 1, 1, 32, 1, 1, 0, stream, None, None)
        ok("cuMemcpyHtoD_v2", dz, src, ctypes.c_size_t(HTOD_SYNC))
        ok("cuMemcpyHtoDAsync_v2", dz, src, ctypes.c_size_t(HTOD_ASYNC), stream)
        ok("cuMemcpyDtoHAsync_v2", pinned, dx, ctypes.c_size_t(DTOH_ASYNC), stream)
        ok("cuMemcpyDtoH_v2", back, dx, ctypes.c_size_t(DTOH_SYNC))
        ok("cuStreamSynchronize", stream)
    after = link_model.read_counts()

    if not unknown:  # gp_test_axpy ran: y = steps * 4 * x (y started at zero)
        ys = (ctypes.c_float * N)()
        ok("cuMemcpyDtoH_v2", ys, dy, ctypes.c_size_t(N * 4))
        last = N - 1
        if ys[last] != float(last) * KERNEL_LAUNCHES["gp_test_axpy"] * steps:
            raise SystemExit(f"known_calls: gp_test_axpy did not compute: y[{last}] = {ys[last]}")
    name = ctypes.create_string_buffer(256)
    ok("cuDeviceGetName", name, 256, dev)
    print(json.dumps({"steps": steps, "device": name.value.decode(), "before": before, "after": after,
                      "diff": link_model.diff_counts(before, after)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
