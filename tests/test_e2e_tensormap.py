"""End to end: TMA descriptors (cuTensorMapEncodeTiled / Im2col / Im2colWide,
cuTensorMapReplaceAddress) from a plain C driver-API program (tests/cuda/tensormap.c) through
gpupool to the simulated GPU: a tiled map on a cuMemAlloc'd buffer (non-zero, a repeated call
answered by the shim's cache without a request, another box size another map), the documented
refusals, im2col, im2col wide and address replacement.

Needs a C compiler and the toolkit's cuda.h (the program is compiled against NVIDIA's header,
not ours, and linked with our libcuda.so).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from conftest import REPO, build_lock, require, run_client

SOURCE = REPO / "tests" / "cuda" / "tensormap.c"
CUDA_INCLUDE = Path(os.environ.get("GPUPOOL_CUDA_INCLUDE", "/usr/local/cuda/include"))
CC = os.environ.get("CC", "cc")


@pytest.fixture(scope="module")
def tensormap_program(native_build: Path) -> Path:
    require((CUDA_INCLUDE / "cuda.h").is_file(), f"no cuda.h in {CUDA_INCLUDE} (GPUPOOL_CUDA_INCLUDE)")
    out = native_build / "cuda-tests" / "tensormap"
    with build_lock(out):  # one build for every process of a parallel run
        if out.exists() and out.stat().st_mtime >= SOURCE.stat().st_mtime:
            return out
        tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        proc = subprocess.run(
            [CC, "-std=c11", "-Wall", "-Wextra", "-Werror", "-I", str(CUDA_INCLUDE), "-o", str(tmp), str(SOURCE),
             "-L", str(native_build / "client"), "-lcuda", "-ldl"],
            capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        tmp.replace(out)
        return out


@pytest.mark.san
def test_tensor_maps_through_gpupool(tensormap_program, gpupool_server):
    env = gpupool_server.client_env({"GPUPOOL_CALL_COUNTS": "1"})
    proc = run_client([tensormap_program], env=env, timeout=60)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines and lines[-1].startswith("PASS tensormap"), (
        f"tensormap did not pass: exit {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n"
        f"--- stderr\n{proc.stderr[-4000:]}\n--- gpupoold log\n{gpupool_server.log_text()[-4000:]}")
    # The cache was exercised: one request for the first tiled map, none for its repeat.
    assert "encode_requests=0,1,1" in proc.stdout, proc.stdout
