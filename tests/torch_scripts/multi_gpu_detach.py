"""A PyTorch program with a lease of 2 GPUs that idles while gpupoold detaches it
(tests/test_e2e_multi_gpu_detach.py, issue 37 acceptance "idle detach of a 2-GPU lease").

Puts random bytes on cuda:0 and cuda:1 (different on each, made on the CPU: the simulated device
runs no PyTorch kernel), prints `ready`, then waits for a line on stdin
(meanwhile the lease is detached and its GPUs used by another client). Then it compares every
byte on both devices with its CPU copy, copies between the two devices, and prints
`PASS multi_gpu_detach` or `FAIL multi_gpu_detach: ...` (exit 1).
"""

from __future__ import annotations

import sys

import torch

SIZE = (5 << 20) + 3  # bytes on each device: odd length, more than one copy chunk


def main() -> int:
    sys.stdout.reconfigure(line_buffering=True)
    torch.cuda.init()  # the lease: before it, torch's NVML-based count lists the server's GPUs
    if torch.cuda.device_count() != 2:
        print(f"FAIL multi_gpu_detach: {torch.cuda.device_count()} devices, not 2")
        return 1
    cpu = [torch.randint(0, 256, (SIZE,), generator=torch.Generator().manual_seed(70 + i),
                         dtype=torch.uint8) for i in range(2)]
    gpu = [cpu[i].to(f"cuda:{i}") for i in range(2)]
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    print("ready")
    sys.stdin.readline()
    problems = []
    for i in range(2):
        if gpu[i].device.index != i:
            problems.append(f"tensor {i} is on device {gpu[i].device}")
        if not torch.equal(gpu[i].cpu(), cpu[i]):
            problems.append(f"the bytes on cuda:{i} differ after the detach")
    across = gpu[0].to("cuda:1")
    if not torch.equal(across.cpu(), cpu[0]):
        problems.append("the copy cuda:0 -> cuda:1 after the detach differs")
    if problems:
        print("FAIL multi_gpu_detach: " + "; ".join(problems))
        return 1
    print("PASS multi_gpu_detach")
    return 0


if __name__ == "__main__":
    sys.exit(main())
