"""A tenant with a memory quota (GPUPOOL_MEMORY=QUOTA; issue 32) sees a GPU of that size.

    GPUPOOL_MEMORY=268435456 python memory_quota.py 268435456

The driver API first (ctypes on the shim's libcuda.so.1, before PyTorch holds anything):
cuMemGetInfo and cuDeviceTotalMem say QUOTA, cuMemAlloc of the quota succeeds and one more byte is
CUDA_ERROR_OUT_OF_MEMORY, cuMemHostAlloc of twice the quota succeeds (host memory is not the
GPU's). Then PyTorch: torch.cuda.mem_get_info() says the quota, a tensor of half of it is made,
and one past what is left raises torch.cuda.OutOfMemoryError, as on a full GPU of that size;
pynvml through our libnvidia-ml.so.1 says the same total, used and free as CUDA.
Prints `PASS memory_quota: N checks` or `FAIL ...` last; exits 1 on any failure.
"""

from __future__ import annotations

import ctypes
import os
import sys

import torch
from checklist import Checklist

checklist = Checklist("memory_quota")
check = checklist.check
OOM = 2  # CUDA_ERROR_OUT_OF_MEMORY


def driver(quota: int) -> None:
    cu = ctypes.CDLL("libcuda.so.1")
    u64 = ctypes.c_uint64
    check(cu.cuInit(0) == 0, "cuInit")
    ctx = ctypes.c_void_p()
    check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0, "cuDevicePrimaryCtxRetain")
    check(cu.cuCtxSetCurrent(ctx) == 0, "cuCtxSetCurrent")
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    check(cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) == 0, "cuMemGetInfo")
    check(total.value == quota, f"cuMemGetInfo total {total.value}, expected {quota}")
    dev_total = ctypes.c_size_t()
    check(cu.cuDeviceTotalMem_v2(ctypes.byref(dev_total), 0) == 0, "cuDeviceTotalMem")
    check(dev_total.value == quota, f"cuDeviceTotalMem {dev_total.value}, expected {quota}")
    check(free.value == quota, f"cuMemGetInfo free {free.value} before any allocation")
    p, q = u64(), u64()
    rc = cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(quota))
    check(rc == 0, f"cuMemAlloc of the whole quota: {rc}")
    rc = cu.cuMemAlloc_v2(ctypes.byref(q), ctypes.c_size_t(1))
    check(rc == OOM, f"cuMemAlloc of the first byte past the quota: {rc}, expected {OOM}")
    check(cu.cuMemFree_v2(p) == 0, "cuMemFree")
    h = ctypes.c_void_p()
    rc = cu.cuMemHostAlloc(ctypes.byref(h), ctypes.c_size_t(2 * quota), 0)
    check(rc == 0, f"cuMemHostAlloc of twice the quota (host memory does not count): {rc}")
    if rc == 0:
        check(cu.cuMemFreeHost(h) == 0, "cuMemFreeHost")
    check(cu.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) == 0, "cuMemGetInfo again")
    check(free.value == quota, f"cuMemGetInfo free {free.value} after the frees")


def torch_view(quota: int) -> None:
    free, total = torch.cuda.mem_get_info(0)
    check(total == quota, f"torch.cuda.mem_get_info total {total}, expected {quota}")
    props = torch.cuda.get_device_properties(0).total_memory
    check(props == quota, f"torch's device properties say {props} bytes, expected {quota}")
    half = torch.empty(quota // 2, dtype=torch.uint8, device="cuda")
    free, _ = torch.cuda.mem_get_info(0)
    check(free <= quota - quota // 2, f"free {free} with half the quota in a tensor")
    try:
        torch.empty(free + (2 << 20), dtype=torch.uint8, device="cuda")
        check(False, "torch.empty past the quota succeeded")
    except torch.cuda.OutOfMemoryError:
        check(True, "torch.empty past the quota")
    nvml(quota, quota - torch.cuda.mem_get_info(0)[0])
    del half


def nvml(quota: int, used: int) -> None:
    """pynvml through our libnvidia-ml.so.1 says what CUDA says."""
    import pynvml as n

    n.nvmlInit()
    h = n.nvmlDeviceGetHandleByIndex(0)
    m = n.nvmlDeviceGetMemoryInfo(h)
    check((m.total, m.used, m.free) == (quota, used, quota - used),
          f"NVML memory {(m.total, m.used, m.free)}, CUDA says {(quota, used, quota - used)}")
    m2 = n.nvmlDeviceGetMemoryInfo(h, version=n.nvmlMemory_v2)
    check((m2.total, m2.used) == (quota, used), f"NVML memory v2 {(m2.total, m2.used)}")
    mine = [p.usedGpuMemory for p in n.nvmlDeviceGetComputeRunningProcesses(h) if p.pid == os.getpid()]
    check(mine in ([], [used]), f"NVML's process list says this process uses {mine}, CUDA {used}")
    n.nvmlShutdown()


def main() -> int:
    quota = int(sys.argv[1])
    checklist.section(lambda: driver(quota), "driver API")
    checklist.section(lambda: torch_view(quota), "PyTorch")
    return checklist.finish()


if __name__ == "__main__":
    sys.exit(main())
