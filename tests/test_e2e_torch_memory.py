"""End to end: PyTorch's two other allocator modes through the shim, on the simulated device.

PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True makes the caching allocator grow segments with
the virtual memory management calls (cuMemAddressReserve, cuMemCreate, cuMemMap, cuMemSetAccess,
cuMemUnmap, cuMemRelease); backend:cudaMallocAsync hands allocation to the driver's stream-ordered
allocator and its default pool (cuMemAllocAsync, cuMemFreeAsync, pool attributes, trim). The
script tests/torch_scripts/memory_backends.py moves tensors of several sizes through each with
copies only and checks them bit for bit and the allocator's statistics.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
from conftest import REPO, require, run_client

SCRIPTS = REPO / "tests" / "torch_scripts"


@pytest.fixture(scope="module")
def torch_ok() -> None:
    require(importlib.util.find_spec("torch") is not None,
            f"torch is not installed in {sys.executable}")


def run_mode(server, mode: str, conf: str):
    env = server.client_env({"PYTORCH_CUDA_ALLOC_CONF": conf})
    proc = run_client([sys.executable, str(SCRIPTS / "memory_backends.py"), mode],
                      env=env, timeout=300)
    out = (f"exit status {proc.returncode}\n--- stdout\n{proc.stdout[-12000:]}\n"
           f"--- stderr\n{proc.stderr[-8000:]}\n--- gpupoold log (tail)\n"
           f"{server.log_text()[-4000:]}")
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines and lines[-1].startswith(
        f"PASS memory_backends {mode}"), out
    # Nothing the allocator used may be missing from the shim.
    assert "not implemented by the gpupool shim" not in proc.stderr, out
    # The worker applied every posted VMM call (no deferred error) and cleaned up at the end.
    log = server.log_text()
    for bad in ("cuMemMap of", "cuMemUnmap of", "cuMemSetAccess of", "cuMemRelease of",
                "cuMemAddressFree of", "VA window are lost", "releasing VMM memory"):
        assert bad not in log, f"worker reported {bad!r}:\n{log[-6000:]}"
    return proc


def test_expandable_segments(torch_ok, gpupool_server):
    run_mode(gpupool_server, "expandable", "expandable_segments:True")


def test_cuda_malloc_async_backend(torch_ok, gpupool_server):
    run_mode(gpupool_server, "async", "backend:cudaMallocAsync")
