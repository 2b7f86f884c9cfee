"""A PyTorch program that idles while its lease is detached (tests/test_e2e_detach.py).

Sets up what a training script holds: tensors of several dtypes on the GPU (about 192 MiB, from
the caching allocator), the cuBLAS handle with its workspace, pinned host buffers with
non-blocking copies in flight on a side stream, an event; prints `ready`, then waits for a line
on stdin (meanwhile gpupoold detaches the lease and another client uses the GPU). Then it
carries on: every tensor is compared with its CPU copy, the cuBLAS handle is the same, pinned
non-blocking copies go both ways, new tensors are allocated next to the old ones, and the
allocator's statistics are what they were. Prints `PASS idle_detach ...` or `FAIL idle_detach:
...` (exit 1).

The simulated device runs no PyTorch kernel, so the script uses none: copies, the allocator,
streams, events and cuBLAS's set-up.
"""

from __future__ import annotations

import sys
import time

import torch

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8]


def main() -> int:
    sys.stdout.reconfigure(line_buffering=True)
    if not torch.cuda.is_available():
        print("FAIL idle_detach: torch.cuda.is_available() is False")
        return 1
    gen = torch.Generator().manual_seed(7)
    cpu = {}
    gpu = {}
    for i, dtype in enumerate(DTYPES):
        n = (8 << 20) // max(1, torch.empty(0, dtype=dtype).element_size()) * 4  # 32 MiB each
        t = torch.randint(0, 120, (n,), generator=gen).to(dtype)
        cpu[i] = t
        gpu[i] = t.cuda()
    big = torch.randint(0, 255, (32 << 20,), generator=gen, dtype=torch.uint8)
    gpu_big = big.cuda()
    handle = torch.cuda.current_blas_handle()
    side = torch.cuda.Stream()
    pinned = torch.empty(16 << 20, dtype=torch.uint8, pin_memory=True)
    with torch.cuda.stream(side):
        pinned.copy_(gpu_big[: 16 << 20], non_blocking=True)
    done = torch.cuda.Event()
    done.record(side)
    done.synchronize()
    if not torch.equal(pinned, big[: 16 << 20]):
        print("FAIL idle_detach: the pinned copy before the idle differs")
        return 1
    allocated = torch.cuda.memory_allocated()
    reserved = torch.cuda.memory_reserved()
    print(f"ready allocated={allocated} reserved={reserved}")
    sys.stdin.readline()

    t0 = time.perf_counter()
    torch.cuda.synchronize()  # the first call after the idle: the lease comes back
    first_ms = (time.perf_counter() - t0) * 1000
    problems = []
    for i, t in gpu.items():
        if not torch.equal(t.cpu(), cpu[i]):
            problems.append(f"tensor {i} ({DTYPES[i]}) differs")
    if not torch.equal(gpu_big.cpu(), big):
        problems.append("the 32 MiB uint8 tensor differs")
    if torch.cuda.current_blas_handle() != handle:
        problems.append("the cuBLAS handle changed")
    back = torch.empty(16 << 20, dtype=torch.uint8, pin_memory=True)
    with torch.cuda.stream(side):
        back.copy_(gpu_big[16 << 20:], non_blocking=True)
        upload = pinned.to("cuda", non_blocking=True)
    side.synchronize()
    if not torch.equal(back, big[16 << 20:]):
        problems.append("a pinned non-blocking download after the idle differs")
    if not torch.equal(upload.cpu(), big[: 16 << 20]):
        problems.append("a pinned non-blocking upload after the idle differs")
    del upload
    if torch.cuda.memory_allocated() != allocated:
        problems.append(f"memory_allocated {torch.cuda.memory_allocated()} != {allocated}")
    extra = torch.ones(1 << 20, dtype=torch.uint8).cuda()  # the allocator carries on
    if int(extra.cpu().sum()) != 1 << 20:
        problems.append("a new tensor after the idle is wrong")
    if problems:
        print("FAIL idle_detach: " + "; ".join(problems))
        return 1
    print(f"PASS idle_detach: {len(gpu) + 1} tensors, cuBLAS handle, pinned copies intact; "
          f"first call after the idle {first_ms:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
