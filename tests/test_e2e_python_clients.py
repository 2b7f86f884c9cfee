"""End to end: CUDA programs written with pycuda and with NVIDIA's cuda-python run unmodified
through gpupool on the simulated device, and pass whole.

Both clients (tests/framework_scripts/pycuda_client.py and cuda_python_client.py) drive the GPU
from Python the way their users do: devices, contexts, allocation, copies in every direction,
streams, events, module loading and launches of the simulated device's test kernels (compiled by
nvcc for pycuda, by NVRTC for cuda-python), globals, and the driver's error codes. cuda-python
runs twice: through its driver API (dlopen of libcuda.so.1) and through its runtime API (the CUDA
runtime it links statically) — the two ways cudart-using programs reach the driver. pycuda uses
the driver API only (it links libcuda.so.1). The same programs pass on a real GPU
(scripts/gpu-validation.sh runs them natively and through gpupool).

pycuda has no wheels: scripts/bootstrap.sh builds it from source (scripts/build-pycuda.sh);
cuda-python (`cuda-bindings`) comes with PyTorch.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys

import pytest
from conftest import REPO, require, run_client

SCRIPTS = REPO / "tests" / "framework_scripts"


def have_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def run_and_expect_pass(server, args: list[str], name: str, env_extra: dict[str, str] | None = None):
    env = server.client_env(env_extra)
    proc = run_client([sys.executable, *args], env=env, timeout=240)
    lines = proc.stdout.strip().splitlines()
    last = lines[-1] if lines else ""
    assert proc.returncode == 0 and last.startswith(f"PASS {name}"), (
        f"{name} did not pass through gpupool (exit {proc.returncode}):\n--- stdout\n"
        f"{proc.stdout[-8000:]}\n--- stderr\n{proc.stderr[-6000:]}\n--- gpupoold log (tail)\n"
        f"{server.log_text()[-4000:]}")
    return proc


@pytest.mark.parametrize("api", ["driver", "runtime"])
def test_cuda_python_client_passes_on_the_simulated_device(gpupool_server, api):
    require(have_module("cuda.bindings"),
            "cuda-bindings is not installed (it comes with PyTorch: scripts/bootstrap.sh)")
    proc = run_and_expect_pass(gpupool_server, [str(SCRIPTS / "cuda_python_client.py"), "--api", api],
                               f"cuda-python-{api}")
    # It ran on gpupool's simulated GPU, not on something else that answered.
    assert "imulated" in proc.stdout, proc.stdout
    # The unsimulated kernel was refused with a message that says why (driver API only).
    if api == "driver":
        said = [ln for ln in proc.stderr.splitlines() if "not_simulated" in ln and "simulated" in ln]
        assert len(said) == 2, proc.stderr  # once from the cubin, once from the PTX


def test_pycuda_client_passes_on_the_simulated_device(gpupool_server):
    require(have_module("pycuda"),
            "pycuda is not installed (scripts/bootstrap.sh builds it with scripts/build-pycuda.sh; "
            "it needs the CUDA toolkit)")
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    require(os.access(nvcc, os.X_OK), "nvcc not found: pycuda compiles its kernels with it")
    proc = run_and_expect_pass(gpupool_server, [str(SCRIPTS / "pycuda_client.py")], "pycuda",
                               {"PATH": f"{os.path.dirname(nvcc)}:{os.environ.get('PATH', '')}"})
    assert "imulated" in proc.stdout, proc.stdout
