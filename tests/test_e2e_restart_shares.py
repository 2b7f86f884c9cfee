"""End to end (issue 32, restart take-over of shares): gpupoold with `share = 2` on one simulated
GPU, two clients with a share each (GPUPOOL_MEMORY=4GiB, tests/clients/hold_gpu.c through the
shim: one streaming copies, one idle) run across a SIGTERM restart; the new daemon takes both
over as shares of that GPU (the API lists two shares of 4 GiB, no whole-GPU lease), scrubs the
GPU neither at its start nor after the first share's end, keeps the second client's wish to keep
its GPU (GPUPOOL_KEEP_GPU, said by its worker), both clients' bytes stay exact, and the GPU is
scrubbed whole once, after both have ended. The unit tests:
tests/test_takeover_shares.py."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from test_e2e_leases import MIB, ended_leases, facts, gpu_states, hold_gpu, start_client, wait_until  # noqa: F401
from test_e2e_restarts import active_ids

SHARE = {"GPUPOOL_MEMORY": "4GiB"}


def test_two_shares_are_taken_over_as_shares_across_a_restart(
        start_daemon: Any, native_build: Path, hold_gpu: Path, tmp_path: Path,  # noqa: F811
        clients: list[subprocess.Popen[str]]) -> None:
    config = tmp_path / "gpupoold.toml"
    config.write_text("share = 2\nsim_memory_gib = 16\nidle_detach_after = 0\n")
    server = start_daemon("--config", str(config), build_dir=native_build)
    wait_until("GPU 0 free", lambda: gpu_states(server) == ["free"], timeout=30)
    tenants = [start_client(server, hold_gpu, 8 * MIB, 5000, seed=51, loops=-1, env=SHARE),
               start_client(server, hold_gpu, 8 * MIB, 5000, seed=52,
                            env={**SHARE, "GPUPOOL_KEEP_GPU": "1"})]
    clients.extend(tenants)
    for t in tenants:
        assert t.stdout is not None and "holding" in t.stdout.readline()
    leases = active_ids(server)
    assert len(leases) == 2

    assert server.stop() == 0, server.log_text()[-3000:]
    assert "2 lease(s) continue without gpupoold" in server.log_text()
    again = start_daemon("--config", str(config), build_dir=native_build,
                         state_dir=server.state_dir)
    wait_until("both taken over", lambda: active_ids(again) == leases, timeout=20)
    (gpu,) = again.get_json("/api/v1/gpus")["gpus"]
    assert gpu["state"] == "leased" and gpu["lease"] is None, gpu
    assert sorted(s["id"] for s in gpu["shares"]["leases"]) == sorted(leases), gpu
    assert {s["memory_quota"] for s in gpu["shares"]["leases"]} == {4 << 30}, gpu
    assert "GPU 0 clean:" not in again.log_text(), "the GPU of the shares was scrubbed"
    # The second client asked to keep its GPU: its worker says so (worker_adopted's flags).
    keeps = [le["detach"]["keep_gpu"] is not None
             for le in again.get_json("/api/v1/leases?state=active")["leases"]]
    assert sorted(keeps) == [False, True], again.get_json("/api/v1/leases?state=active")

    for i, t in enumerate(tenants):
        out, err = t.communicate(timeout=60)
        assert t.returncode == 0 and facts(out)["exact"] == "1", (
            f"share {i} failed ({t.returncode}):\n{out}\n{err}\n{again.log_text()[-4000:]}")
    wait_until("both ended, the GPU scrubbed whole and free",
               lambda: len(ended_leases(again)) == 2 and gpu_states(again) == ["free"], timeout=20)
    log = again.log_text()
    assert log.count("GPU 0 clean:") == 1, log[-3000:]
    ends = [log.index(f"lease {lease} ended (") for lease in leases]
    assert max(ends) < log.index("GPU 0 clean:"), "scrubbed before both shares ended"
    assert [r["scrub_ok"] for r in ended_leases(again)].count(True) == 1  # the last one's


def test_a_whole_gpu_lease_with_a_memory_cap_is_taken_over_whole(
        start_daemon: Any, native_build: Path, hold_gpu: Path, tmp_path: Path,  # noqa: F811
        clients: list[subprocess.Popen[str]]) -> None:
    """GPUPOOL_MEMORY on an unshared GPU caps a whole-GPU lease; restarted with the GPU shared,
    its worker says it did not run as a share (worker_adopted's flags), so it stays whole."""
    config = tmp_path / "gpupoold.toml"
    config.write_text("sim_memory_gib = 16\nidle_detach_after = 0\n")
    server = start_daemon("--config", str(config), build_dir=native_build)
    wait_until("GPU 0 free", lambda: gpu_states(server) == ["free"], timeout=30)
    tenant = start_client(server, hold_gpu, 8 * MIB, 3000, seed=53, env=SHARE)
    clients.append(tenant)
    assert tenant.stdout is not None and "holding" in tenant.stdout.readline()
    leases = active_ids(server)
    assert server.stop() == 0, server.log_text()[-3000:]
    config.write_text("share = 2\nsim_memory_gib = 16\nidle_detach_after = 0\n")
    again = start_daemon("--config", str(config), build_dir=native_build,
                         state_dir=server.state_dir)
    wait_until("taken over", lambda: active_ids(again) == leases, timeout=20)
    (gpu,) = again.get_json("/api/v1/gpus")["gpus"]
    assert gpu["lease"] is not None and not gpu["shares"]["leases"], gpu
    out, err = tenant.communicate(timeout=60)
    assert tenant.returncode == 0 and facts(out)["exact"] == "1", f"{out}\n{err}"
