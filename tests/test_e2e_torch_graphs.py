"""End to end: PyTorch CUDA graphs through the shim on the simulated device.

torch.cuda.graph captures device-to-device copies (no kernel: the simulated device has no
PyTorch kernels) on its side stream; the worker captures on its real stream, and every replay
must see the inputs as they are then (tests/torch_scripts/graph_capture.py).
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


def test_graph_capture_of_copies(torch_ok, gpupool_server) -> None:
    proc = run_client([sys.executable, str(SCRIPTS / "graph_capture.py")],
                      env=gpupool_server.client_env(), timeout=300)
    lines = proc.stdout.strip().splitlines()
    detail = (f"exit status {proc.returncode}\n--- stdout\n{proc.stdout[-8000:]}\n"
              f"--- stderr\n{proc.stderr[-8000:]}\n--- gpupoold log (tail)\n"
              f"{gpupool_server.log_text()[-4000:]}")
    assert proc.returncode == 0 and lines and lines[-1].startswith("PASS graph_capture"), detail
    # Everything torch.cuda.graph calls is implemented by the shim.
    assert "not implemented" not in proc.stderr, detail
