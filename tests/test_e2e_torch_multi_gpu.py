"""End to end (issue 37): PyTorch jobs of several GPUs through the shim, on simulated GPUs.

- torch.distributed with gloo and CUDA tensors: 2 processes with 1 GPU each on one server of 2
  simulated GPUs (tests/torch_scripts/gloo_collectives.py): all_reduce, broadcast, all_gather
  bit-exact. The two ranks wait for each other inside the collectives, so the test passing
  also says that both held a lease at the same time (one queued behind the other would time
  out); the lease history then shows them on the two different GPUs.
- One process with GPUPOOL_GPUS=4 through gpupoold on 4 simulated GPUs, one worker holding the 4:
  4 devices, a tensor on each, .to() between every pair bit-exact
  (tests/torch_scripts/multi_device.py).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from conftest import REPO, require, run_client

SCRIPTS = REPO / "tests" / "torch_scripts"


@pytest.fixture(scope="module")
def torch_ok() -> None:
    require(importlib.util.find_spec("torch") is not None,
            f"torch is not installed in {sys.executable}")


def show(proc, server) -> str:
    return (f"exit status {proc.returncode}\n--- stdout\n{proc.stdout[-12000:]}\n"
            f"--- stderr\n{proc.stderr[-8000:]}\n--- gpupoold log (tail)\n"
            f"{server.log_text()[-4000:]}")


def test_gloo_cuda_tensors_two_processes(torch_ok, native_build: Path, start_daemon,
                                         tmp_path: Path):
    server = start_daemon(simulated=2, build_dir=native_build)
    store = tmp_path / "gloo-store"
    proc = run_client([sys.executable, str(SCRIPTS / "gloo_collectives.py"), "--world", "2",
                       "--init", store.as_uri()], env=server.client_env(), timeout=300)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines and lines[-1] == "PASS gloo: 2 ranks", \
        show(proc, server)
    for rank in (0, 1):
        assert any(line.startswith(f"PASS gloo rank {rank}:") for line in lines), \
            show(proc, server)
    leases = server.get_json("/api/v1/leases?state=all")["leases"]
    assert len(leases) == 2, leases
    assert {le["gpu_index"] for le in leases} == {0, 1}, leases
    assert all(le["gpus"] == [le["gpu_index"]] for le in leases), leases  # one GPU each


def test_one_process_four_devices(torch_ok, native_build: Path, start_daemon):
    """GPUPOOL_GPUS=4 through gpupoold on 4 simulated GPUs: one lease of the 4, one worker
    holding them as 4 devices (the simulated device opens gpupoold's peers as devices); PyTorch
    sees 4 devices, a tensor on each, .to() between every ordered pair bit-exact, NVML lists the
    4 (tests/torch_scripts/multi_device.py). The lease's record lists the 4 GPUs, all free after."""
    server = start_daemon(simulated=4, build_dir=native_build)
    proc = run_client([sys.executable, str(SCRIPTS / "multi_device.py"), "--devices", "4"],
                      env=server.client_env({"GPUPOOL_GPUS": "4"}), timeout=300)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines and lines[-1].startswith("PASS multi_device"), \
        show(proc, server)
    leases = server.get_json("/api/v1/leases?state=all")["leases"]
    assert len(leases) == 1 and sorted(leases[0]["gpus"]) == [0, 1, 2, 3], leases
    server.wait_for_log(r"the lease has 4 devices")  # one worker opened all four
