"""The shim's image parser (client/shim/image.c) against images nvcc really produces, and the
module / launch / attribute / occupancy entry points against a fake shim core.

tests/c/test_image.c and tests/c/test_module_api.c do the checking; this file compiles a cubin
and a fatbin of known kernels at test time and hands their paths to the first.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from conftest import require, run_client
from test_e2e_cuda import nvcc_path

SOURCE = r"""
struct big { int v[100]; };  /* 400 bytes */
extern "C" __global__ void k(float a, const float *x, float *y, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        y[i] = a * x[i] + y[i];
}
extern "C" __global__ void kbig(struct big b, long long *out)
{
    out[0] = b.v[0] + b.v[99];
}
"""


def _binary(native_build: Path, name: str) -> Path:
    binary = native_build / "tests" / name
    require(binary.is_file(), f"{binary} not built")
    return binary


@pytest.mark.san
def test_synthetic_images(native_build: Path) -> None:
    proc = run_client([_binary(native_build, "test_image")], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "checks passed" in proc.stdout


@pytest.mark.san
def test_nvcc_cubin_and_fatbin(native_build: Path, tmp_path: Path) -> None:
    binary = _binary(native_build, "test_image")
    nvcc = nvcc_path()
    require(nvcc, "needs nvcc (the CUDA toolkit)")
    src = tmp_path / "k.cu"
    src.write_text(SOURCE)
    cubin, fatbin = tmp_path / "k.cubin", tmp_path / "k.fatbin"
    for flag, out_path in (("-cubin", cubin), ("-fatbin", fatbin)):
        proc = subprocess.run([nvcc, flag, "-arch=sm_90", "-o", str(out_path), str(src)],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = run_client([binary, cubin, fatbin], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "checks passed" in proc.stdout


@pytest.mark.san
def test_module_api_against_fake_core(native_build: Path) -> None:
    proc = run_client([_binary(native_build, "test_module_api")], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "checks passed" in proc.stdout
