"""End to end: PyTorch's CUDA wheel through the shim, on the simulated device.

The scripts in tests/torch_scripts/ run as client processes (the interpreter running pytest,
with the environment of gpupool_server.client_env()). The simulated device has no PyTorch
kernels, so these tests stay with what needs none: device queries, memory statistics, streams,
events and transfers (a contiguous same-dtype copy is a plain cuMemcpy*Async); kernel_op.py
checks that an op needing a kernel fails clearly instead of hanging. blas_init.py and
triton_probe.py take cuBLAS / cuBLASLt and Triton through everything up to the first kernel
launch: handle creation, library and module loading, device probing.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys

import pytest
from conftest import REPO, require, run_client

SCRIPTS = REPO / "tests" / "torch_scripts"
GIB = 1 << 30


@pytest.fixture(scope="module")
def torch_ok() -> None:
    require(importlib.util.find_spec("torch") is not None,
            f"torch is not installed in {sys.executable}")


def run_script(server, name: str, *args: str, timeout: float = 300,
               env: dict[str, str] | None = None):
    return run_client([sys.executable, str(SCRIPTS / name), *args],
                      env=server.client_env(env), timeout=timeout)


def show(proc, server) -> str:
    return (f"exit status {proc.returncode}\n--- stdout\n{proc.stdout[-12000:]}\n"
            f"--- stderr\n{proc.stderr[-8000:]}\n--- gpupoold log (tail)\n"
            f"{server.log_text()[-4000:]}")


def assert_pass(proc, server, name: str) -> None:
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines and lines[-1].startswith(f"PASS {name}"), show(proc, server)


def test_device_properties(torch_ok, gpupool_server):
    proc = run_script(gpupool_server, "device_info.py", timeout=120)
    assert proc.returncode == 0, show(proc, gpupool_server)
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "error" not in info, f"{info.get('error')}\n{info.get('traceback')}\n{proc.stderr}"
    assert info["is_available"] is True, show(proc, gpupool_server)
    assert info["device_count"] == 1
    gpu = gpupool_server.get_json("/api/v1/gpus")["gpus"][0]
    assert info["name"] == gpu["name"]
    assert "simulated" in info["name"].lower()
    assert f"GPU-{info['uuid']}".lower() == gpu["uuid"].lower() or \
        info["uuid"].lower() == gpu["uuid"].lower(), (info["uuid"], gpu["uuid"])
    assert info["total_memory"] == 80 * GIB
    assert (info["major"], info["minor"]) == (9, 0)
    assert info["multi_processor_count"] == 132
    assert info["mem_get_info"][1] == 80 * GIB


def test_runtime_streams_events_memory(torch_ok, gpupool_server):
    proc = run_script(gpupool_server, "runtime.py", timeout=300)
    assert_pass(proc, gpupool_server, "runtime")


def test_transfers_every_dtype(torch_ok, gpupool_server):
    """Every dtype, 1 element to 17 MiB, every transfer method."""
    proc = run_script(gpupool_server, "transfers.py", timeout=600)
    assert_pass(proc, gpupool_server, "transfers")


def test_transfers_256mib(torch_ok, gpupool_server):
    """256 MiB tensors of every dtype: .cuda(), non_blocking, pinned; bit-exact."""
    proc = run_script(gpupool_server, "transfers.py", "--sizes", "256MiB",
                      "--methods", "cuda,to_nb,pinned", timeout=900)
    assert_pass(proc, gpupool_server, "transfers")


def test_op_needing_a_kernel_fails_clearly(torch_ok, gpupool_server):
    """torch.ones on the simulated device: a RuntimeError, and the shim names the kernel."""
    proc = run_script(gpupool_server, "kernel_op.py", timeout=120)
    assert proc.returncode == 0, show(proc, gpupool_server)
    if "RAISED" not in proc.stdout:
        pytest.fail("torch.ones on the simulated device did not raise:\n"
                    + show(proc, gpupool_server), pytrace=False)
    # PyTorch's fill kernel is a templated elementwise kernel in namespace at::native.
    assert "kernel" in proc.stderr.lower() and "at6native" in proc.stderr, (
        "the shim's stderr does not name the kernel that the simulated device cannot run:\n"
        + show(proc, gpupool_server))


SIM_REFUSAL = "cannot run on the simulated device"


def json_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_cublas_and_cublaslt_initialise(torch_ok, gpupool_server):
    """cuBLAS handle creation (current_blas_handle) needs no kernel and must succeed; a GEMM per
    backend and dtype then creates the cuBLASLt handle and gets to its kernel launch, which only
    the simulated device refuses (clearly: no crash, no cuBLAS error before the launch)."""
    proc = run_script(gpupool_server, "blas_init.py", timeout=180)
    assert_pass(proc, gpupool_server, "blas_init")
    lines = json_lines(proc.stdout)
    assert int(lines[0]["blas_handle"], 16) != 0 and lines[0]["cublas_workspace"] > 0, lines[0]
    gemms = lines[1:]
    assert {(g["backend"], g["dtype"]) for g in gemms} == {
        ("cublas", "float32"), ("cublas", "float16"), ("cublaslt", "float32"),
        ("cublaslt", "float16"), ("cublaslt", "bfloat16")}, gemms
    for bad in ("unknown table", "is not implemented by the gpupool shim"):
        assert bad not in proc.stderr, show(proc, gpupool_server)
    if all(g["outcome"] == "raised" for g in gemms):  # the simulated device
        refused = re.findall(rf"launch of kernel '([^']+)' failed: .*{SIM_REFUSAL}", proc.stderr)
        # cuBLAS's fp32 SIMT GEMM and the nvjet kernels of the fp16 / bf16 paths.
        assert any("gemm" in k for k in refused) and any(k.startswith("nvjet") for k in refused), (
            "the shim did not name the refused GEMM kernels:\n" + show(proc, gpupool_server))


def test_triton_driver_probing(torch_ok, gpupool_server, tmp_path):
    """Triton: the CUDA driver is active, its C helper builds against our libcuda.so, the device
    properties agree with PyTorch's, a @triton.jit kernel compiles and its cubin loads
    (cuModuleLoadData, cuModuleGetFunction, cuFuncGetAttribute); the launch is refused clearly
    on the simulated device."""
    require(importlib.util.find_spec("triton") is not None,
            f"triton is not installed in {sys.executable}")
    proc = run_script(gpupool_server, "triton_probe.py", timeout=240,
                      env={"TRITON_CACHE_DIR": str(tmp_path / "triton-cache")})
    assert_pass(proc, gpupool_server, "triton_probe")
    steps = {line["step"]: line for line in json_lines(proc.stdout)}
    assert steps["load"]["module"] and steps["load"]["function"], steps
    gpu = gpupool_server.get_json("/api/v1/gpus")["gpus"][0]
    assert steps["device"]["props"]["multiprocessor_count"] == 132, steps["device"]
    if "simulated" in gpu["name"].lower():
        assert steps["launch"]["outcome"] == "raised", steps["launch"]
        assert re.search(rf"launch of kernel 'probe_add' failed: .*{SIM_REFUSAL}",
                         proc.stderr), show(proc, gpupool_server)
