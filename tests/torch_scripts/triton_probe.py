"""Triton's CUDA driver probing, compilation and module loading through the shim
(tests/test_e2e_torch.py). Set TRITON_CACHE_DIR: Triton builds a C helper there.

Steps, each printed as one JSON line ({"step": ..., ...}):
  driver   triton.runtime.driver.active is the CUDA driver; its utils (CudaUtils) compile
           Triton's driver.c with gcc and link -lcuda: our libcuda.so from LD_LIBRARY_PATH
  device   get_current_device(), get_current_target(), utils.get_device_properties(device),
           compared with what torch.cuda.get_device_properties reports
  compile  a small @triton.jit kernel compiled (ptxas bundled with Triton) without launching
  load     CompiledKernel._init_handles(): cuModuleLoadData of Triton's cubin, cuModuleGetFunction,
           cuFuncGetAttribute (registers, spills, max threads)
  launch   the kernel launched and synchronised: on a real GPU the sum is checked; on the
           simulated device it must raise (the shim names the kernel on stderr)
Then `PASS triton_probe ...` or `FAIL triton_probe: ...`; exits 1 on FAIL.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import triton
import triton.language as tl

N, BLOCK = 256, 128


@triton.jit
def probe_add(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask),
             mask=mask)


def emit(step: str, **fields: Any) -> None:
    print(json.dumps({"step": step, **fields}, default=str))


def fail(msg: str) -> int:
    print(f"FAIL triton_probe: {msg}")
    return 1


def main() -> int:
    sys.stdout.reconfigure(line_buffering=True)
    if not os.environ.get("TRITON_CACHE_DIR"):
        return fail("TRITON_CACHE_DIR is not set (point it at a temporary directory)")
    if not torch.cuda.is_available():
        return fail("torch.cuda.is_available() is False")
    simulated = "simulated" in torch.cuda.get_device_name(0).lower()
    from triton.runtime import driver

    active = driver.active
    utils = active.utils
    emit("driver", driver=type(active).__name__, utils=type(utils).__name__,
         triton=triton.__version__)
    if type(active).__name__ != "CudaDriver":
        return fail(f"the active Triton driver is {type(active).__name__}, not CudaDriver")

    dev = active.get_current_device()
    target = active.get_current_target()
    props = utils.get_device_properties(dev)
    tp = torch.cuda.get_device_properties(dev)
    emit("device", device=dev, arch=target.arch, warp_size=target.warp_size, props=props)
    expect = {
        "multiprocessor_count": tp.multi_processor_count,
        "max_shared_mem": tp.shared_memory_per_block_optin,
        "warpSize": tp.warp_size,
        "sm_clock_rate": tp.clock_rate,
        "mem_clock_rate": tp.memory_clock_rate,
        "mem_bus_width": tp.memory_bus_width,
    }
    diffs = {k: (props.get(k), v) for k, v in expect.items() if props.get(k) != v}
    if diffs:
        return fail(f"Triton and PyTorch disagree on the device (triton, torch): {diffs}")
    if target.arch != tp.major * 10 + tp.minor or props.get("max_num_regs", 0) <= 0:
        return fail(f"target {target} / max_num_regs {props.get('max_num_regs')} do not match "
                    f"compute capability {tp.major}.{tp.minor}")

    # Inputs by copy only (no kernel needed): the simulated device cannot run PyTorch's kernels.
    x_cpu = torch.arange(N, dtype=torch.float32)
    y_cpu = torch.full((N,), 0.5)
    x, y = x_cpu.cuda(), y_cpu.cuda()
    out = torch.zeros(N).cuda()
    grid = (triton.cdiv(N, BLOCK),)
    compiled = probe_add.warmup(x, y, out, N, BLOCK=BLOCK, grid=grid)
    cubin = compiled.asm.get("cubin", b"")
    emit("compile", kernel=compiled.name, cubin_bytes=len(cubin))
    if not cubin:
        return fail("Triton produced no cubin")

    compiled._init_handles()  # cuModuleLoadData, cuModuleGetFunction, cuFuncGetAttribute
    emit("load", module=bool(compiled.module), function=bool(compiled.function),
         n_regs=compiled.n_regs, n_spills=compiled.n_spills,
         n_max_threads=compiled.n_max_threads)
    if not compiled.module or not compiled.function:
        return fail("cuModuleLoadData / cuModuleGetFunction gave a NULL handle")
    if not 0 < compiled.n_regs <= 255 or compiled.n_max_threads <= 0:
        return fail(f"implausible function attributes: {compiled.n_regs} registers, "
                    f"{compiled.n_max_threads} max threads")

    try:
        probe_add[grid](x, y, out, N, BLOCK=BLOCK)
        torch.cuda.synchronize()
        got = out.cpu()
    except RuntimeError as exc:
        msg = " ".join(str(exc).split())[:400]
        emit("launch", outcome="raised", error=msg)
        if not simulated:
            return fail(f"the launch raised on a real GPU: {msg}")
        print(f"PASS triton_probe simulated=True cubin_bytes={len(cubin)} launch=refused")
        return 0
    ok = bool(torch.equal(got, x_cpu + y_cpu))
    emit("launch", outcome="computed", correct=ok)
    if not ok:
        return fail("the kernel computed a wrong sum")
    if simulated:
        return fail("the simulated device ran a Triton kernel it cannot run")
    print(f"PASS triton_probe simulated=False cubin_bytes={len(cubin)} launch=computed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
