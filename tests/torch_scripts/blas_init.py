"""cuBLAS and cuBLASLt initialisation through the shim (tests/test_e2e_torch.py).

What needs no kernel: `torch.cuda.current_blas_handle()` creates the cuBLAS handle (cublasCreate:
cuBLAS's own static cudart handshake, its library load, occupancy probing of
`nopClusterDiscoveryTool`, the `deviceConstants` global) and gives it its workspace. PyTorch
exposes no getter for the cuBLASLt handle; a matmul with `preferred_blas_library("cublaslt")`
creates it (cublasLtCreate, the export tables 21318c60 / 1734dc26, raw cubins loaded with
cuLibraryLoadData, heuristics) and gets as far as launching the GEMM kernel. A real GPU computes
the product; the simulated device refuses the launch with its clear message, which the shim
prints naming the kernel. Every other failure (an error before the launch, a crash) is a bug.

Prints one JSON line per GEMM ({"backend", "dtype", "outcome": "computed"|"raised", "error"}),
then `PASS blas_init ...` or `FAIL blas_init: ...`; exits 1 on FAIL.
"""

from __future__ import annotations

import json
import sys

import torch

GEMMS = [("cublas", torch.float32), ("cublas", torch.float16), ("cublaslt", torch.float32),
         ("cublaslt", torch.float16), ("cublaslt", torch.bfloat16)]
N = 64


def gemm(backend: str, dtype: torch.dtype) -> dict[str, object]:
    torch.backends.cuda.preferred_blas_library(backend)
    cpu_a = torch.arange(N * N, dtype=torch.float32).reshape(N, N).remainder(7).to(dtype)
    cpu_b = torch.eye(N, dtype=dtype)
    # Plain copies (no kernel): the inputs reach the device through cuMemcpyHtoDAsync.
    a, b = cpu_a.cuda(), cpu_b.cuda()
    out: dict[str, object] = {"backend": backend, "dtype": str(dtype).removeprefix("torch.")}
    try:
        c = a @ b
        torch.cuda.synchronize()
        got = c.cpu()
    except RuntimeError as exc:
        out["outcome"] = "raised"
        out["error"] = " ".join(str(exc).split())[:400]
        return out
    out["outcome"] = "computed"
    out["correct"] = bool(torch.equal(got, cpu_a))  # B is the identity: exact in every dtype
    return out


def main() -> int:
    sys.stdout.reconfigure(line_buffering=True)
    if not torch.cuda.is_available():
        print("FAIL blas_init: torch.cuda.is_available() is False")
        return 1
    simulated = "simulated" in torch.cuda.get_device_name(0).lower()
    torch.cuda.init()
    torch.empty(1, device="cuda")  # a current context, as every real program has by now
    handle = torch.cuda.current_blas_handle()
    if not handle:
        print("FAIL blas_init: current_blas_handle() returned a NULL handle")
        return 1
    if torch.cuda.current_blas_handle() != handle:
        print("FAIL blas_init: a second current_blas_handle() gave another handle")
        return 1
    # The workspace sizes are private helpers that not every PyTorch has (2.11 lacks the cuBLAS one).
    sizes = {name: getattr(torch._C, f"_cuda_get{name}WorkspaceSize", lambda: None)()
             for name in ("Cublas", "CublasLt")}
    print(json.dumps({"blas_handle": hex(handle), "cublas_workspace": sizes["Cublas"],
                      "cublaslt_workspace": sizes["CublasLt"]}))
    problems = []
    for backend, dtype in GEMMS:
        res = gemm(backend, dtype)
        print(json.dumps(res))
        what = f"{backend} {res['dtype']}"
        if res["outcome"] == "computed" and not res["correct"]:
            problems.append(f"{what}: wrong product")
        elif res["outcome"] == "raised" and not simulated:
            problems.append(f"{what}: raised on a real GPU: {res['error']}")
        elif res["outcome"] == "raised" and "operation not supported" not in str(res["error"]):
            # The sim's refusal of the GEMM kernel reads as cudaErrorNotSupported; anything
            # else (CUBLAS_STATUS_INTERNAL_ERROR, NOT_INITIALIZED...) failed before the launch.
            problems.append(f"{what}: failed before the kernel launch: {res['error']}")
    torch.backends.cuda.preferred_blas_library("cublas")
    if problems:
        print("FAIL blas_init: " + "; ".join(problems))
        return 1
    print(f"PASS blas_init handle={hex(handle)} gemms={len(GEMMS)} simulated={simulated}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
