"""End to end (issue 37, item 2): a lease of two GPUs outlives a gpupoold restart. A client with
GPUPOOL_GPUS=2 on gpupoold --simulated 2 keeps reading both devices back while the daemon is
stopped (SIGTERM) and started again; the new daemon takes its lease over on both GPUs (neither
scrubbed at its start, neither given to a client that waits meanwhile), the client's bytes stay
exact on both devices and across a peer copy, and when it ends both GPUs are scrubbed before the
waiting client gets one. Real gpupoold, real worker (one worker holds both devices), a ctypes
client (tests/clients/hold_gpus.py). The unit tests: tests/test_takeover_multi_gpu.py."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from conftest import REPO
from test_e2e_detach import detach_server, detached, lease_of, stop_detached
from test_e2e_leases import MIB, ended_leases, facts, gpu_states, hold_gpu, start_client, wait_until  # noqa: F401
from test_e2e_restarts import active_ids, restart

CLIENT = REPO / "tests" / "clients" / "hold_gpus.py"


def test_a_lease_of_two_gpus_is_taken_over_across_a_restart(
        start_daemon: Any, native_build: Path, hold_gpu: Path,  # noqa: F811
        clients: list[subprocess.Popen[str]]) -> None:
    server = start_daemon("--simulated", "2", build_dir=native_build, simulated=None)
    wait_until("both GPUs free", lambda: gpu_states(server) == ["free", "free"])
    tenant = subprocess.Popen([sys.executable, str(CLIENT), "2", str(4 * MIB)],
                              env=server.client_env({"GPUPOOL_GPUS": "2"}), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    clients.append(tenant)
    assert tenant.stdout is not None
    line = tenant.stdout.readline()
    assert line.startswith("holding"), f"{line}{tenant.stderr.read() if tenant.stderr else ''}"
    (lease,) = server.get_json("/api/v1/leases?state=active")["leases"]
    assert lease["gpus"] == [0, 1], lease

    restarted_at = time.time()
    again = restart(start_daemon, server, "sigterm")
    wait_until("the lease taken over", lambda: active_ids(again) == {lease["id"]}, timeout=20)
    assert gpu_states(again) == ["leased", "leased"]
    assert [g["lease"]["id"] for g in again.get_json("/api/v1/gpus")["gpus"]] == [lease["id"]] * 2
    assert again.get_json(f"/api/v1/leases/{lease['id']}")["gpus"] == [0, 1]
    newcomer = start_client(again, hold_gpu, MIB, 0, seed=41)
    clients.append(newcomer)
    time.sleep(1.0)
    assert newcomer.poll() is None and active_ids(again) == {lease["id"]}, \
        "a GPU of the lease taken over was given away"
    log = again.log_text()
    assert f"taking over 1 lease(s) of the previous gpupoold: lease {lease['id']} on GPU 0, 1" \
        in log, log[-3000:]
    assert "GPU 0 clean:" not in log and "GPU 1 clean:" not in log, "a GPU of the lease scrubbed"

    out, err = tenant.communicate("go\n", timeout=60)
    assert tenant.returncode == 0 and "PASS hold_gpus" in out, (
        f"the tenant failed ({tenant.returncode}):\n{out}\n{err}\n{again.log_text()[-4000:]}")
    ended_at = time.time()
    n = facts(newcomer.communicate(timeout=60)[0])
    assert newcomer.returncode == 0 and n["exact"] == "1", n
    assert float(n["t_leased"]) >= ended_at - 1.0, "the waiting client got a GPU of the lease"

    wait_until("both leases ended and scrubbed", lambda: [
        r["scrub_ok"] for r in ended_leases(again)] == [True, True], timeout=20)
    rec = again.get_json(f"/api/v1/leases/{lease['id']}")
    assert rec["end_reason"] == "client exit" and rec["gpus"] == [0, 1], rec
    assert rec["started"] < restarted_at < rec["ended"], rec
    log = again.log_text()
    assert "GPU 0 clean:" in log and "GPU 1 clean:" in log, log[-3000:]
    wait_until("both GPUs free", lambda: gpu_states(again) == ["free", "free"])


def test_a_detached_lease_of_two_gpus_is_taken_over_and_comes_back_bit_exact(
        start_daemon: Any, native_build: Path, tmp_path: Path,
        clients: list[subprocess.Popen[str]]) -> None:
    """Idle detach takes the 2-GPU lease off both GPUs (policy "always"); gpupoold is stopped
    (SIGTERM: the lease continues, its worker parked) and started again; the new daemon takes it
    over detached, and the client's next call brings it back on two GPUs with every byte on both
    devices intact."""
    server = detach_server(start_daemon, native_build, tmp_path, gpus=2, detach_policy="always")
    tenant = subprocess.Popen([sys.executable, str(CLIENT), "2", str(4 * MIB), "idle"],
                              env=server.client_env({"GPUPOOL_GPUS": "2"}), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    clients.append(tenant)
    assert tenant.stdout is not None
    line = tenant.stdout.readline()
    assert line.startswith("holding"), f"{line}{tenant.stderr.read() if tenant.stderr else ''}"
    (lease,) = server.get_json("/api/v1/leases?state=active")["leases"]
    stop_detached(server, lease)
    again = start_daemon("--simulated", "2", "--config", str(tmp_path / "gpupoold.toml"),
                         build_dir=native_build, simulated=None, state_dir=server.state_dir)
    wait_until("taken over detached", lambda: detached(again, lease["id"]), timeout=20)
    assert f"lease {lease['id']} taken over detached (from GPU 0, 1" in again.log_text()
    wait_until("both GPUs free meanwhile", lambda: gpu_states(again) == ["free", "free"])
    out, err = tenant.communicate("go\n", timeout=60)
    assert tenant.returncode == 0 and "PASS hold_gpus" in out, (
        f"the tenant failed ({tenant.returncode}):\n{out}\n{err}\n{again.log_text()[-4000:]}")
    # (its detach's scrub no longer counts once it came back: store.lease_event)
    wait_until("the lease ended and scrubbed", lambda: lease_of(again, lease["id"])["scrub_ok"]
               is not None, timeout=20)
    rec = lease_of(again, lease["id"])
    assert rec["end_reason"] == "client exit" and rec["scrub_ok"] is True, rec
    assert "attached" in [e["state"] for e in rec["events"]], rec["events"]
