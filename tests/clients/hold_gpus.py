"""hold_gpus: a tenant of several GPUs on the driver API through ctypes, for the restart take-over
of a lease of several GPUs (tests/test_e2e_restart_multi_gpu.py).

    GPUPOOL_GPUS=N python hold_gpus.py N BYTES [idle]

Loads libcuda.so.1 (ours, first on LD_LIBRARY_PATH), checks that it sees N devices, puts BYTES
of different random bytes on each, prints `holding`, then reads every device's buffer back again
and again (a job that keeps working while its server restarts) until a line arrives on stdin;
with `idle` it makes no call meanwhile (a lease that idle detach takes off its GPUs).
Then it checks every device once more, copies device 0's buffer to device 1 (cuMemcpyPeer), and
prints `PASS hold_gpus copies=C` (C: the read-backs, each bit-exact) and exits 0; otherwise
`FAIL hold_gpus: ...` and exit 1 (a CUDA error: its name and the call).
"""

from __future__ import annotations

import ctypes
import os
import select
import sys


class Failed(Exception):
    pass


def main() -> int:
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[attr-defined]
    want, size = int(sys.argv[1]), int(sys.argv[2])
    idle = sys.argv[3:] == ["idle"]
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
    ctxs, ptrs, data = [], [], []
    for ordinal in range(want):
        dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
        check("cuDeviceGet", ctypes.byref(dev), ordinal)
        check("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
        check("cuCtxSetCurrent", ctx)
        check("cuMemAlloc_v2", ctypes.byref(ptr), ctypes.c_size_t(size))
        mine = os.urandom(size)
        check("cuMemcpyHtoD_v2", ptr, ctypes.create_string_buffer(mine, size),
              ctypes.c_size_t(size))
        ctxs.append(ctx)
        ptrs.append(ptr)
        data.append(mine)
    back = ctypes.create_string_buffer(size)

    def read_back(ordinal: int, what: str) -> None:
        check("cuCtxSetCurrent", ctxs[ordinal])
        check("cuMemcpyDtoH_v2", back, ptrs[ordinal], ctypes.c_size_t(size))
        if back.raw != data[ordinal]:
            raise Failed(f"the bytes of device {ordinal} differ {what}")

    print("holding", flush=True)
    copies = 0
    while not select.select([sys.stdin], [], [], None if idle else 0.05)[0]:
        for ordinal in range(want):
            read_back(ordinal, f"at read-back {copies}")
            copies += 1
    sys.stdin.readline()
    for ordinal in range(want):
        read_back(ordinal, "at the end")
    if want > 1:  # device 0's bytes to device 1, then read back from device 1
        check("cuMemcpyPeer", ptrs[1], ctxs[1], ptrs[0], ctxs[0], ctypes.c_size_t(size))
        check("cuCtxSetCurrent", ctxs[1])
        check("cuMemcpyDtoH_v2", back, ptrs[1], ctypes.c_size_t(size))
        if back.raw != data[0]:
            raise Failed("device 0's bytes copied to device 1 differ")
    print(f"PASS hold_gpus copies={copies}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Failed as exc:
        print(f"FAIL hold_gpus: {exc}")
        sys.exit(1)
