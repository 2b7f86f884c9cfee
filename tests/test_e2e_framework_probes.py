"""End to end: the GPU validation's framework probes (tests/framework_scripts) on a gpupoold with
a simulated GPU, as far as a simulated device goes.

The cuda-bindings probe (NVIDIA's `cuda.bindings`, installed with PyTorch) finds every driver
entry point through cuGetProcAddress, compiles a kernel with NVRTC and hands it to the driver as
PTX text and as a cubin. The simulated device loads both images but runs only its own test
kernels: the launch must then fail with the simulator's clear error, never silently, while the
context, the loads and the error answers pass. On a real GPU (scripts/gpu-validation.sh) the same
probe must pass whole. CuPy, JAX and numba do not install on these machines; their probes run on
a lent GPU only.
"""

from __future__ import annotations

import importlib.util
import sys

from conftest import REPO, require, run_client

PROBE = REPO / "tests" / "framework_scripts" / "cuda_python_probe.py"


def test_cuda_bindings_probe_on_the_simulated_device(gpupool_server):
    require(importlib.util.find_spec("cuda") is not None and importlib.util.find_spec("cuda.bindings")
            is not None, "cuda-bindings is not installed (it comes with PyTorch: scripts/bootstrap.sh)")
    proc = run_client([sys.executable, PROBE], env=gpupool_server.client_env(), timeout=120)
    out = proc.stdout + proc.stderr
    # The driver entry points, NVRTC and the context work; both images load.
    assert "device 0: " in proc.stdout and "imulated" in proc.stdout, out
    for part in ("context", "errors"):
        assert f"check failed: {part} raised" not in proc.stdout, out
    assert "NVRTC's PTX has no gp_scale entry" not in proc.stdout, out
    # Each launch of the NVRTC kernel fails with an error that says the GPU is simulated: the
    # PTX one at the launch (the shim knows the image holds no simulated kernel), the cubin one
    # from the worker at the next synchronisation.
    said = [ln for ln in proc.stderr.splitlines()
            if ln.startswith("gpupool: ") and "gp_scale" in ln and "simulated" in ln]
    assert len(said) == 2, out
    assert proc.stdout.count("CUDA_ERROR_NOT_SUPPORTED") == 2, out
    assert proc.returncode == 1 and proc.stdout.strip().splitlines()[-1] == \
        "FAIL cuda-python: 2 of 6 checks failed", out
