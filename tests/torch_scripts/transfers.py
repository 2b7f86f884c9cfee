"""Tensors of every dtype and many sizes survive host <-> device transfers bit for bit.

    python transfers.py [--sizes SPEC,...] [--dtypes NAME,...] [--methods NAME,...]

SPEC is an element count (`7`) or a byte size (`1MiB`, `256MiB`, `4096B`); the default is the
small set. For every (dtype, size, method) a random tensor (random *bytes*, so NaN payloads,
denormals and every bit pattern are included) goes to the device and back, and the raw bytes are
compared through `.view(torch.uint8)`. Only transfers are used: the simulated device has no
PyTorch kernels, and a contiguous same-dtype copy is a plain cuMemcpy*Async.

Methods:
  cuda     t.cuda() -> .cpu()
  to_nb    t.to("cuda", non_blocking=True) -> .to("cpu", non_blocking=True) + synchronize
  pinned   t.pin_memory() -> .to("cuda", non_blocking=True) -> copy_ into a pinned tensor
           (non_blocking) + synchronize
  offset   odd storage offsets on both sides: host slice [3:] -> copy_ into device slice [5:]
  d2d      device -> device clone (cudaMemcpyAsync D2D) -> .cpu()
  stream   copies on a side stream, ordered back to the current stream by an event

Prints one line per failed case and a summary `PASS transfers: N cases` or
`FAIL transfers: K of N cases failed`; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
import zlib

import torch

ALL_DTYPES = [
    "float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64",
    "bool", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2", "uint16", "uint32",
    "uint64",
]
ALL_METHODS = ["cuda", "to_nb", "pinned", "offset", "d2d", "stream"]
SMALL_SIZES = "1,7,4099,1MiB,17MiB"


def parse_size(spec: str, elem: int) -> int:
    """Number of elements for SPEC: a plain count, or bytes with a B/KiB/MiB/GiB suffix."""
    m = re.fullmatch(r"(\d+)\s*(B|KiB|MiB|GiB)?", spec.strip())
    if not m:
        raise SystemExit(f"bad size {spec!r}")
    n, unit = int(m.group(1)), m.group(2)
    if unit is None:
        return n
    mult = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[unit]
    return max(1, n * mult // elem)


_random_bytes: dict[int, torch.Tensor] = {}


def random_tensor(dtype: torch.dtype, numel: int, seed: int) -> torch.Tensor:
    """numel elements of random bytes. The bytes of one size are drawn once and shared by all
    dtypes (drawing 256 MiB per dtype would cost more than the transfers)."""
    elem = torch.empty((), dtype=dtype).element_size()
    nbytes = numel * elem
    if nbytes not in _random_bytes:
        g = torch.Generator().manual_seed(seed)
        _random_bytes[nbytes] = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    raw = _random_bytes[nbytes]
    if dtype == torch.bool:
        raw = raw & 1  # only 0/1 are valid bools
    return raw.view(dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """None when a and b hold the same bytes, else a description of the first difference."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"got {b.dtype} {tuple(b.shape)}, expected {a.dtype} {tuple(a.shape)}"
    if b.device.type != "cpu":
        return f"result on {b.device}, expected cpu"
    ab, bb = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    if torch.equal(ab, bb):
        return None
    diff = (ab != bb).nonzero()
    i = int(diff[0])
    return (f"{diff.numel()} of {ab.numel()} bytes differ; first at byte {i}: "
            f"got 0x{int(bb[i]):02x}, expected 0x{int(ab[i]):02x}")


def roundtrip(method: str, t: torch.Tensor) -> torch.Tensor:
    if method == "cuda":
        g = t.cuda()
        assert g.is_cuda
        return g.cpu()
    if method == "to_nb":
        g = t.to("cuda", non_blocking=True)
        back = g.to("cpu", non_blocking=True)
        torch.cuda.synchronize()
        return back
    if method == "pinned":
        p = t.pin_memory()
        assert p.is_pinned(), "pin_memory() returned a tensor that is not pinned"
        g = p.to("cuda", non_blocking=True)
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(g, non_blocking=True)
        torch.cuda.synchronize()
        return out
    if method == "offset":
        host = torch.empty(t.numel() + 3, dtype=t.dtype)
        host[3:].view(torch.uint8).copy_(t.view(torch.uint8))  # CPU byte copy, no conversion
        src = host[3:]
        dev = torch.empty(t.numel() + 5, dtype=t.dtype, device="cuda")
        dev[5:].copy_(src)
        back = torch.empty(t.numel() + 1, dtype=t.dtype)
        back[1:].copy_(dev[5:])
        return back[1:].clone()
    if method == "d2d":
        g = t.cuda()
        g2 = g.clone()
        del g
        return g2.cpu()
    if method == "stream":
        side = torch.cuda.Stream()
        p = t.pin_memory()
        with torch.cuda.stream(side):
            g = p.to("cuda", non_blocking=True)
            ev = side.record_event()
        torch.cuda.current_stream().wait_event(ev)
        g.record_stream(torch.cuda.current_stream())
        return g.cpu()
    raise SystemExit(f"unknown method {method!r}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default=SMALL_SIZES)
    ap.add_argument("--dtypes", default=",".join(ALL_DTYPES))
    ap.add_argument("--methods", default=",".join(ALL_METHODS))
    args = ap.parse_args()
    sys.stdout.reconfigure(line_buffering=True)

    if not torch.cuda.is_available():
        print("FAIL transfers: torch.cuda.is_available() is False")
        return 1
    print(f"device: {torch.cuda.get_device_name(0)}")
    cases = failures = 0
    t_start = time.monotonic()
    for dname in args.dtypes.split(","):
        dtype = getattr(torch, dname, None)
        if not isinstance(dtype, torch.dtype):
            print(f"  skip {dname}: not a dtype of torch {torch.__version__}")
            continue
        elem = torch.empty((), dtype=dtype).element_size()
        for spec in args.sizes.split(","):
            numel = parse_size(spec, elem)
            t = random_tensor(dtype, numel, seed=zlib.crc32(spec.encode()))
            for method in args.methods.split(","):
                cases += 1
                try:
                    problem = same_bytes(t, roundtrip(method, t))
                except Exception as exc:  # noqa: BLE001 - every case is reported
                    problem = f"raised {type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
                if problem:
                    failures += 1
                    print(f"  case failed: {dname} x {numel} ({numel * elem} bytes) via {method}: "
                          f"{problem}")
            del t
        print(f"  {dname}: done at {time.monotonic() - t_start:.1f} s")
    took = time.monotonic() - t_start
    if failures:
        print(f"FAIL transfers: {failures} of {cases} cases failed ({took:.1f} s)")
        return 1
    print(f"PASS transfers: {cases} cases ({took:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
