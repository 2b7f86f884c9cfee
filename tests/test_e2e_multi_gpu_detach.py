"""End to end (issue 37, acceptance "idle detach of a 2-GPU lease and its return on two other
GPUs, bit-exact"): gpupoold on 4 simulated GPUs, a PyTorch program with GPUPOOL_GPUS=2 holding
different bytes on both of its devices idles and is detached from both GPUs at once
(detach_policy "always"); another client of 2 GPUs takes those two; the program's next call
brings its lease back on the other two GPUs (every GPU paired in the restore,
pool/detach.py), and every byte on both devices is intact
(tests/torch_scripts/multi_gpu_detach.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from conftest import REPO
from test_e2e_detach import detach_server
from test_e2e_leases import MIB, gpu_states, hold_gpu, start_client, wait_until  # noqa: F401
from test_e2e_torch_multi_gpu import torch_ok  # noqa: F401

SCRIPT = REPO / "tests" / "torch_scripts" / "multi_gpu_detach.py"


def test_a_lease_of_two_gpus_detaches_and_comes_back_on_two_others_bit_exact(
        torch_ok: None, start_daemon: Any, native_build: Path, hold_gpu: Path,  # noqa: F811
        tmp_path: Path, clients: list[subprocess.Popen[str]]) -> None:
    server = detach_server(start_daemon, native_build, tmp_path, gpus=4, detach_policy="always")
    tenant = subprocess.Popen([sys.executable, str(SCRIPT)],
                              env=server.client_env({"GPUPOOL_GPUS": "2"}), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    clients.append(tenant)
    assert tenant.stdout is not None
    ready = tenant.stdout.readline()
    assert ready.startswith("ready"), f"{ready}{tenant.stderr.read() if tenant.stderr else ''}"
    (lease,) = server.get_json("/api/v1/leases?state=active")["leases"]
    assert sorted(lease["gpus"]) == [0, 1], lease
    wait_until("detached", lambda: server.get_json(f"/api/v1/leases/{lease['id']}")["detach"]
               ["state"] == "detached", timeout=30)
    wait_until("all GPUs free", lambda: gpu_states(server) == ["free"] * 4, timeout=30)
    # Another client takes GPUs 0 and 1 (the first free ones) and keeps them.
    holder = start_client(server, hold_gpu, 16 * MIB, 60000, seed=9,
                          env={"GPUPOOL_GPUS": "2", "GPUPOOL_KEEP_GPU": "1"})
    clients.append(holder)
    assert holder.stdout is not None and "holding" in holder.stdout.readline()
    held = [g["lease"] is not None for g in server.get_json("/api/v1/gpus")["gpus"]]
    assert held == [True, True, False, False], held
    out, err = tenant.communicate("go\n", timeout=300)
    assert tenant.returncode == 0 and "PASS multi_gpu_detach" in out, (
        f"the tenant did not pass ({tenant.returncode}):\n{out}\n{err}\n"
        f"{server.log_text()[-6000:]}")
    rec = server.get_json(f"/api/v1/leases/{lease['id']}")
    # (Under policy "always" it may detach and come back again while it checks.)
    attached = [e for e in rec["events"] if e["state"] == "attached"]
    assert attached and attached[0]["gpu"] == 2, rec
    # Every GPU it left and came back on, in its program's order (schema v15).
    assert rec["events"][0]["state"] == "detached" and rec["events"][0]["gpus"] == [0, 1], rec
    assert attached[0]["gpus"] == [2, 3], rec
    assert "moved from GPU 0, 1" in attached[0]["detail"], rec
    assert rec["detaches"] >= 1, rec
    server.wait_for_log(r"attached again on GPU 2, 3 \(moved from GPU 0, 1\)")
    holder.kill()
    holder.communicate(timeout=60)
