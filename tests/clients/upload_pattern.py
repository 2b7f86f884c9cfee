"""upload_pattern: a tenant on the driver API through ctypes, for the wire-capture tests
(tests/test_trust.py).

    python upload_pattern.py PATTERN_FILE

Loads libcuda.so.1 (ours, first on LD_LIBRARY_PATH), takes the GPU, uploads the bytes of
PATTERN_FILE to device memory, reads them back and checks them. Prints `ok N` and exits 0 when
the bytes came back exact; on a refused connection the shim's own message is on stderr and the
exit status is 1 (the CUDA error code is printed too).
"""

from __future__ import annotations

import ctypes
import sys


def main() -> int:
    data = open(sys.argv[1], "rb").read()
    cuda = ctypes.CDLL("libcuda.so.1")

    def check(name: str, *args: object) -> None:
        rc = getattr(cuda, name)(*args)
        if rc != 0:
            print(f"upload_pattern: {name} -> {rc}", file=sys.stderr)
            raise SystemExit(1)

    dev, ctx, dptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
    check("cuInit", 0)
    check("cuDeviceGet", ctypes.byref(dev), 0)
    check("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
    check("cuCtxSetCurrent", ctx)
    check("cuMemAlloc_v2", ctypes.byref(dptr), ctypes.c_size_t(len(data)))
    src = ctypes.create_string_buffer(data, len(data))
    check("cuMemcpyHtoD_v2", dptr, src, ctypes.c_size_t(len(data)))
    back = ctypes.create_string_buffer(len(data))
    check("cuMemcpyDtoH_v2", back, dptr, ctypes.c_size_t(len(data)))
    if back.raw != data:
        print("upload_pattern: the bytes read back differ", file=sys.stderr)
        return 2
    print(f"ok {len(data)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
