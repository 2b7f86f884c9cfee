"""PyTorch's caching allocator in the mode chosen by PYTORCH_CUDA_ALLOC_CONF, through copies only.

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python memory_backends.py expandable
    PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync  python memory_backends.py async

Tensors of several sizes (1 byte .. 64 MiB, odd sizes included) go to the device, are cloned
there (a device-to-device copy), come back and must be bit-exact; then they are freed and the
allocator statistics must be sane: allocated memory back to where it started, reserved memory
at least what was allocated while the tensors lived, empty_cache() returning it. No kernel is
needed (the simulated device has none of PyTorch's): every operation is a copy.
Prints `PASS memory_backends <mode>: N checks` or `FAIL ...` last; exits 1 on any failure.
"""

from __future__ import annotations

import os
import sys

import torch
from checklist import Checklist

checklist = Checklist("memory_backends")
check = checklist.check


SIZES = [1, 7, 4099, 1 << 20, (1 << 20) + 3, 3 << 20, 21 << 20, 64 << 20]


def run(mode: str) -> None:
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    want = {"expandable": "expandable_segments:True", "async": "backend:cudaMallocAsync"}[mode]
    check(want in conf, f"PYTORCH_CUDA_ALLOC_CONF={conf!r} should contain {want!r}")
    backend = torch.cuda.get_allocator_backend()
    want_backend = "cudaMallocAsync" if mode == "async" else "native"
    check(backend == want_backend, f"allocator backend {backend!r}, expected {want_backend!r}")

    dev = torch.device("cuda", 0)
    torch.cuda.synchronize()
    base_alloc = torch.cuda.memory_allocated(dev)
    gen = torch.Generator().manual_seed(1234)
    hosts = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in SIZES]

    for round_no in range(2):  # the second round reuses what the allocator kept
        devs = [h.to(dev) for h in hosts]
        clones = [d.clone() for d in devs]  # device-to-device copies
        total = sum(SIZES)
        alloc = torch.cuda.memory_allocated(dev) - base_alloc
        check(alloc >= 2 * total, f"round {round_no}: memory_allocated grew by {alloc} bytes, "
              f"expected at least {2 * total}")
        reserved = torch.cuda.memory_reserved(dev)
        check(reserved >= alloc, f"round {round_no}: memory_reserved {reserved} < allocated {alloc}")
        for i, (h, d, c) in enumerate(zip(hosts, devs, clones, strict=True)):
            back = d.cpu()
            check(torch.equal(back, h), f"round {round_no}: tensor {i} ({SIZES[i]} B) differs "
                  "after the round trip")
            check(torch.equal(c.cpu(), h), f"round {round_no}: clone {i} differs")
        # A copy into an odd offset of a large tensor, across the 2 MiB boundaries.
        big = devs[-1]
        src = hosts[5]
        big[12345:12345 + src.numel()].copy_(src.to(dev))
        expect = hosts[-1].clone()
        expect[12345:12345 + src.numel()] = src
        check(torch.equal(big.cpu(), expect), f"round {round_no}: offset copy into the 64 MiB "
              "tensor differs")
        del devs, clones, big, d, c
        torch.cuda.synchronize()
        after = torch.cuda.memory_allocated(dev)
        check(after == base_alloc, f"round {round_no}: memory_allocated {after} after freeing, "
              f"expected {base_alloc}")

    stats = torch.cuda.memory_stats(dev)
    if mode == "expandable":
        check(stats.get("num_alloc_retries", 0) == 0, f"alloc retries: {stats}")
        check(stats.get("allocated_bytes.all.peak", 0) >= 2 * sum(SIZES),
              f"allocated peak {stats.get('allocated_bytes.all.peak')} too small")
        check(stats.get("reserved_bytes.all.current", 0) > 0, "nothing reserved before empty_cache")
    else:
        # cudaMallocAsync backend: PyTorch reads the pool's attributes.
        check(stats.get("reserved_bytes.all.peak", 0) >= 2 * sum(SIZES),
              f"pool reserved peak {stats.get('reserved_bytes.all.peak')} too small: {stats}")
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved(dev)
    check(reserved == 0, f"memory_reserved {reserved} after empty_cache, expected 0")
    free_b, total_b = torch.cuda.mem_get_info(dev)
    check(0 < free_b <= total_b, f"mem_get_info {free_b}/{total_b}")

    # Everything still works after empty_cache.
    t = hosts[-2].to(dev)
    check(torch.equal(t.cpu(), hosts[-2]), "tensor after empty_cache differs")


def main() -> int:
    mode = sys.argv[1] if len(sys.argv) > 1 else "expandable"
    if mode not in ("expandable", "async"):
        raise SystemExit("usage: memory_backends.py expandable|async")
    checklist.name = f"memory_backends {mode}"
    checklist.section(lambda: run(mode), f"run({mode!r})")
    return checklist.finish()


if __name__ == "__main__":
    sys.exit(main())
