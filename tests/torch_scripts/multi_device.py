"""PyTorch with a lease of several GPUs (issue 37, acceptance "PyTorch": run with
GPUPOOL_GPUS=N against a server of N simulated GPUs).

Checks: torch.cuda.device_count() == --devices once CUDA is initialised; each device has its
own UUID and name, and NVML's device count agrees (torch.cuda's NVML-based count, which lists
the lease once the process holds it); a tensor made on every device lives
there (its device index, and torch.cuda.memory_allocated(i) grew on that device only), the
tensors' address ranges do not overlap; `.to()` between every ordered pair of devices
(synchronous, and non_blocking on a side stream of the source device) is bit-exact against the
CPU copy; the peer-access answer of every pair is a bool.

The simulated device runs no PyTorch kernel, so the tensors are made on the CPU and moved
(contiguous copies of one dtype: cuMemcpy* between devices, no kernel). Prints one line per
failed check and `PASS multi_device: N checks` or `FAIL multi_device: K of N checks failed`.
"""

from __future__ import annotations

import argparse
import sys

import torch
from checklist import Checklist

checklist = Checklist("multi_device")
check = checklist.check
SIZE = (3 << 20) + 5  # bytes of each tensor: more than one copy chunk, odd length


def source(i: int) -> torch.Tensor:
    """What device i holds: random bytes, different for each device."""
    gen = torch.Generator().manual_seed(37 + i)
    return torch.randint(0, 256, (SIZE,), generator=gen, dtype=torch.uint8)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4)
    n = parser.parse_args().devices
    sys.stdout.reconfigure(line_buffering=True)
    # Before CUDA starts, PyTorch's count is NVML's count of the servers' GPUs (docs/multi-gpu.md,
    # "Before and after the lease"); after it, CUDA's: the lease's.
    torch.cuda.init()
    count = torch.cuda.device_count()
    if not check(count == n, f"torch.cuda.device_count() = {count}, expected {n}"):
        return checklist.finish()

    def identities() -> None:
        props = [torch.cuda.get_device_properties(i) for i in range(n)]
        uuids = {str(p.uuid) for p in props}
        check(len(uuids) == n, f"the {n} devices have {len(uuids)} distinct UUIDs: {uuids}")
        check(all(p.name for p in props), "a device without a name")
        nvml = torch.cuda._device_count_nvml()
        check(nvml == n, f"NVML counts {nvml} devices, CUDA {n}")

    tensors: dict[int, torch.Tensor] = {}

    def placement() -> None:
        for i in range(n):
            before = [torch.cuda.memory_allocated(d) for d in range(n)]
            tensors[i] = source(i).to(f"cuda:{i}")
            after = [torch.cuda.memory_allocated(d) for d in range(n)]
            check(tensors[i].device == torch.device("cuda", i),
                  f"the tensor for cuda:{i} is on {tensors[i].device}")
            grew = [d for d in range(n) if after[d] != before[d]]
            check(grew == [i], f"allocating on cuda:{i} changed memory_allocated of {grew}")
        spans = sorted((t.data_ptr(), t.data_ptr() + SIZE, i) for i, t in tensors.items())
        for (_, end, a), (start, _, b) in zip(spans, spans[1:], strict=False):
            check(end <= start, f"the tensors of cuda:{a} and cuda:{b} overlap")

    def copies() -> None:
        for i in range(n):
            for j in range(n):
                if i == j:
                    continue
                moved = tensors[i].to(f"cuda:{j}")
                check(moved.device == torch.device("cuda", j), f".to(cuda:{j}) from cuda:{i} "
                      f"landed on {moved.device}")
                check(torch.equal(moved.cpu(), source(i)), f"cuda:{i} -> cuda:{j} differs")
                with torch.cuda.device(i):
                    side = torch.cuda.Stream()
                    with torch.cuda.stream(side):
                        late = tensors[i].to(f"cuda:{j}", non_blocking=True)
                    side.synchronize()
                check(torch.equal(late.cpu(), source(i)),
                      f"cuda:{i} -> cuda:{j} non_blocking on a side stream differs")

    def peers() -> None:
        for i in range(n):
            for j in range(n):
                if i != j:
                    answer = torch.cuda.can_device_access_peer(i, j)
                    check(isinstance(answer, bool), f"can_device_access_peer({i}, {j}) = {answer!r}")

    checklist.section(identities)
    checklist.section(placement)
    if len(tensors) == n:
        checklist.section(copies)
    checklist.section(peers)
    return checklist.finish()


if __name__ == "__main__":
    sys.exit(main())
