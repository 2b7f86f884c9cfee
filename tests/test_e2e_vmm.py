"""End to end: tests/cuda/vmm.cu (virtual memory management and the default memory pool)
through shim -> TCP -> gpupoold -> worker -> simulated device, with shared and static cudart.

The program checks its own results (docs in the file); here we also require that the shim
reported no unimplemented call and said nothing else on stderr than its one line about
cuMemPoolCreate (refused over gpupool: only the default pool exists).
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import pytest
from conftest import require, run_client
from test_e2e_cuda import MODES, CudaPrograms, nvcc_path, show


class VmmProgram(CudaPrograms):
    """Builds only vmm.cu, in both cudart modes, in the background."""

    def __init__(self, nvcc: str, out_dir: Path) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.nvcc = nvcc
        self.out_dir = out_dir
        self._pool = ThreadPoolExecutor(max_workers=2)
        self._builds: dict[tuple[str, str], Future[Path]] = {
            ("vmm", mode): self._pool.submit(self._build, "vmm", mode) for mode in MODES}


@pytest.fixture(scope="module")
def vmm_program(native_build: Path):
    nvcc = nvcc_path()
    require(nvcc is not None, "nvcc (CUDA toolkit) not found: the CUDA test programs cannot be built")
    progs = VmmProgram(nvcc, native_build / "cuda-tests")
    yield progs
    progs.close()


@pytest.fixture(params=MODES, ids=lambda m: f"cudart-{m}")
def mode(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.mark.san
def test_vmm_and_pools(vmm_program, gpupool_server, mode):
    exe = vmm_program.path("vmm", mode)
    proc = run_client([exe], env=gpupool_server.client_env(), timeout=300)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines and lines[-1].startswith("PASS vmm"), (
        f"vmm ({mode} cudart) did not pass:\n{show(proc, gpupool_server)}")
    assert "not implemented" not in proc.stderr, show(proc, gpupool_server)
    # The worker applied every posted VMM call (no deferred error) and cleaned up at the end.
    log = gpupool_server.log_text()
    for bad in ("cuMemMap of", "cuMemUnmap of", "cuMemSetAccess of", "cuMemRelease of",
                "cuMemAddressFree of", "VA window are lost", "releasing VMM memory"):
        assert bad not in log, f"worker reported {bad!r}:\n{log[-6000:]}"
    # The refusal of cuMemPoolCreate says what to do, once.
    assert proc.stderr.count("cuMemPoolCreate: only the default memory pool") == 1, \
        show(proc, gpupool_server)
