#!/usr/bin/env python3
"""spread_client: the client of bench/spread_bench.py, peer copies of a lease spread over servers.

    GPUPOOL_GPUS=4 GPUPOOL_SPREAD=1 python spread_client.py [--devices 4] [--mib 256] [--reps 3]
                                                            [--pairs 0:2,2:0,0:1]

The driver API through ctypes (libcuda.so.1 first on LD_LIBRARY_PATH: the shim). It checks that
it sees --devices devices, allocates --mib MiB on each, checks that their pointer ranges never
overlap and that cuPointerGetAttribute(DEVICE_ORDINAL) names each one's device, fills the source
of every pair with random bytes of its own, then, for each SRC:DST pair, times cuMemcpyPeer from
SRC's buffer into a buffer of DST (both contexts synchronised inside the timing), the best of
--reps. Before each copy the destination is zeroed, after it read back and compared with the
source's bytes, both outside the timing: every copy must be bit-exact.

Prints one line `RESULT {json}` (devices, can_access_peer for each pair, and per pair the bytes,
the best seconds and bytes per second) and `PASS spread_client`, exit 0; otherwise
`FAIL spread_client: <what failed>` (a CUDA error: the call, its name and number), exit 1.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time

MIB = 1 << 20
CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9


class Failed(Exception):
    pass


class Driver:
    """libcuda.so.1 with every call's return code checked."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")

    def __call__(self, name: str, *args: object) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            text = ctypes.c_char_p()
            self.lib.cuGetErrorName(rc, ctypes.byref(text))
            raise Failed(f"{name} -> {(text.value or b'?').decode()} ({rc})")


def parse_pairs(text: str) -> list[tuple[int, int]]:
    pairs = []
    for item in text.split(","):
        src, _, dst = item.partition(":")
        pairs.append((int(src), int(dst)))
    return pairs


def run(args: argparse.Namespace) -> dict[str, object]:
    size = args.mib * MIB
    pairs = parse_pairs(args.pairs)
    cu = Driver()
    cu("cuInit", 0)
    count = ctypes.c_int()
    cu("cuDeviceGetCount", ctypes.byref(count))
    if count.value != args.devices:
        raise Failed(f"{count.value} devices, not {args.devices} (GPUPOOL_GPUS, GPUPOOL_SPREAD?)")
    if any(not (0 <= d < args.devices) for pair in pairs for d in pair):
        raise Failed(f"--pairs {args.pairs} names a device outside 0..{args.devices - 1}")
    ctxs: list[ctypes.c_void_p] = []
    home: list[int] = []  # each device's own buffer: a peer copy's source
    for ordinal in range(args.devices):
        dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
        cu("cuDeviceGet", ctypes.byref(dev), ordinal)
        cu("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
        cu("cuCtxSetCurrent", ctx)
        cu("cuMemAlloc_v2", ctypes.byref(ptr), ctypes.c_size_t(size))
        ctxs.append(ctx)
        home.append(ptr.value)
    dest: dict[int, int] = {}  # a destination buffer on each device some pair copies to
    for _, dst in pairs:
        if dst not in dest:
            ptr = ctypes.c_uint64()
            cu("cuCtxSetCurrent", ctxs[dst])
            cu("cuMemAlloc_v2", ctypes.byref(ptr), ctypes.c_size_t(size))
            dest[dst] = ptr.value
    owner = [(p, d) for d, p in enumerate(home)] + [(p, d) for d, p in dest.items()]
    ranges = sorted(owner)
    for (lo, d1), (hi, d2) in zip(ranges, ranges[1:]):
        if lo + size > hi:
            raise Failed(f"the buffers of devices {d1} and {d2} overlap: {lo:#x} and {hi:#x}, "
                         f"{size} bytes each")
    for ptr, d in owner:
        ordinal = ctypes.c_int(-1)
        cu("cuPointerGetAttribute", ctypes.byref(ordinal), CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
           ctypes.c_uint64(ptr))
        if ordinal.value != d:
            raise Failed(f"cuPointerGetAttribute(DEVICE_ORDINAL, {ptr:#x}) says device "
                         f"{ordinal.value}, the buffer is on device {d}")
    data: dict[int, bytes] = {}
    for src, _ in pairs:
        if src not in data:
            data[src] = os.urandom(size)
            cu("cuCtxSetCurrent", ctxs[src])
            cu("cuMemcpyHtoD_v2", ctypes.c_uint64(home[src]),
               ctypes.create_string_buffer(data[src], size), ctypes.c_size_t(size))
    peer_access = {}
    for src, dst in pairs:
        can = ctypes.c_int(-1)
        cu("cuDeviceCanAccessPeer", ctypes.byref(can), dst, src)
        peer_access[f"{dst}:{src}"] = can.value
    back = ctypes.create_string_buffer(size)
    copies = []
    for src, dst in pairs:
        best = float("inf")
        for rep in range(args.reps):
            cu("cuCtxSetCurrent", ctxs[dst])
            cu("cuMemsetD8_v2", ctypes.c_uint64(dest[dst]), ctypes.c_ubyte(0),
               ctypes.c_size_t(size))
            cu("cuCtxSynchronize")
            t0 = time.perf_counter()
            cu("cuMemcpyPeer", ctypes.c_uint64(dest[dst]), ctxs[dst], ctypes.c_uint64(home[src]),
               ctxs[src], ctypes.c_size_t(size))
            cu("cuCtxSynchronize")  # the destination's context is current
            cu("cuCtxSetCurrent", ctxs[src])
            cu("cuCtxSynchronize")
            best = min(best, time.perf_counter() - t0)
            cu("cuCtxSetCurrent", ctxs[dst])
            cu("cuMemcpyDtoH_v2", back, ctypes.c_uint64(dest[dst]), ctypes.c_size_t(size))
            if back.raw != data[src]:
                raise Failed(f"the copy from device {src} to device {dst} (rep {rep + 1}) "
                             "differs from the source's bytes")
        copies.append({"src": src, "dst": dst, "bytes": size, "best_s": best,
                       "bps": size / best, "reps": args.reps, "exact": True})
    # The lease, its contexts and its buffers end with the process.
    return {"devices": count.value, "ranges_distinct": True, "pointer_ordinals": True,
            "can_access_peer": peer_access, "copies": copies}


def main() -> int:
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[attr-defined]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--mib", type=int, default=256, help="size of each copy, in MiB")
    ap.add_argument("--reps", type=int, default=3, help="copies of each pair; the best counts")
    ap.add_argument("--pairs", default="0:2,2:0,0:1", help="SRC:DST device ordinals")
    args = ap.parse_args()
    try:
        result = run(args)
    except (Failed, OSError, ValueError) as exc:
        print(f"FAIL spread_client: {exc}")
        return 1
    print("RESULT " + json.dumps(result))
    print("PASS spread_client")
    return 0


if __name__ == "__main__":
    sys.exit(main())
