"""End to end: idle detach (docs/architecture.md, "Idle detach"; pool/detach.py, worker/detach.c).

A tenant that idles while another client waits gives its GPU back: the waiting client gets the
GPU, scrubbed, and the first tenant's next call brings its state back, on the same GPU or on
another of the same model, every byte where it was. Real gpupoold, workers, gpupool-checkpoint
and clients on simulated GPUs.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, GpupoolServer, require
from test_e2e_cuda import cuda_programs  # noqa: F401
from test_e2e_leases import MIB, facts, gpu_states, hold_gpu, start_client, wait_until  # noqa: F401


def detach_server(start_daemon: Any, native_build: Path, tmp_path: Path, gpus: int = 1,
                  **settings: Any) -> GpupoolServer:
    conf = tmp_path / "gpupoold.toml"
    values = {"idle_detach_after": 0.5, **settings}
    conf.write_text("".join(f"{k} = {v!r}\n".replace("'", '"') for k, v in values.items()))
    server = start_daemon("--simulated", str(gpus), "--config", str(conf), build_dir=native_build,
                          simulated=None)
    wait_until("GPUs free", lambda: gpu_states(server) == ["free"] * gpus)
    return server


def finish(proc: subprocess.Popen[str], what: str, timeout: float = 120) -> dict[str, str]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"{what} failed ({proc.returncode}):\n{out}\n{err}"
    return facts(out)


def lease_of(server: GpupoolServer, lease_id: int) -> dict[str, Any]:
    return server.get_json(f"/api/v1/leases/{lease_id}")


def test_an_idle_tenant_gives_its_gpu_to_a_waiting_client_and_gets_it_back_intact(
        start_daemon: Any, native_build: Path, hold_gpu: Path, tmp_path: Path,  # noqa: F811
        clients: list[subprocess.Popen[str]]) -> None:
    server = detach_server(start_daemon, native_build, tmp_path)
    first = start_client(server, hold_gpu, 64 * MIB, 6000, seed=41)
    clients.append(first)
    assert first.stdout is not None and "holding" in first.stdout.readline()
    second = start_client(server, hold_gpu, 64 * MIB, 300, seed=42)
    clients.append(second)
    f2 = finish(second, "the waiting client")
    assert f2["exact"] == "1" and f2["nonzero_before"] == "0"
    f1 = finish(first, "the idle tenant")
    assert f1["exact"] == "1" and f1["nonzero_before"] == "0"
    # The second ran while the first was detached: it started after the first had leased.
    assert float(f2["t_leased"]) < float(f1["t_end"])
    leases = server.get_json("/api/v1/leases?state=all")["leases"]
    first_rec = [le for le in leases if le["client_pid"] == first.pid][0]
    assert first_rec["detaches"] >= 1, first_rec


def start_tenant(cuda_programs: Any, server: GpupoolServer, mib: int,  # noqa: F811
                 clients: list[subprocess.Popen[str]], *args: str,  # noqa: F811
                 env: dict[str, str] | None = None,
                 first: str = "ready") -> subprocess.Popen[str]:
    """tests/cuda/detach.cu (with `args` after MIB), once it has printed `first`: set up and idle
    (waiting for a line on stdin), or (`first` "spinning") in its long kernel."""
    exe = cuda_programs.path("detach", "shared")
    proc = subprocess.Popen([str(exe), str(mib), *args], env=server.client_env(env),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    clients.append(proc)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith(first), f"{line}{proc.stderr.read() if proc.stderr else ''}"
    return proc


def detached_tenant(start_daemon: Any, native_build: Path, cuda_programs: Any,  # noqa: F811
                    tmp_path: Path, clients: list[subprocess.Popen[str]],  # noqa: F811
                    mib: int) -> tuple[GpupoolServer, subprocess.Popen[str], dict[str, Any]]:
    """A server that detaches at once (policy always) and a tenant of `mib` MiB, detached."""
    server = detach_server(start_daemon, native_build, tmp_path, detach_policy="always")
    tenant = start_tenant(cuda_programs, server, mib, clients)
    lease = the_lease(server)
    wait_until("detached", lambda: detached(server, lease["id"]), timeout=20)
    return server, tenant, lease


def resume(proc: subprocess.Popen[str], server: GpupoolServer) -> str:
    out, err = proc.communicate("go\n", timeout=300)
    assert proc.returncode == 0 and "PASS detach" in out, (
        f"the tenant did not pass ({proc.returncode}):\n{out}\n{err}\n{server.log_text()[-6000:]}")
    return out


def the_lease(server: GpupoolServer) -> dict[str, Any]:
    (lease,) = server.get_json("/api/v1/leases?state=active")["leases"]
    return lease


def test_two_gib_of_state_survive_a_detach_while_another_client_uses_the_gpu(
        start_daemon: Any, native_build: Path, cuda_programs: Any, hold_gpu: Path,  # noqa: F811
        tmp_path: Path, clients: list[subprocess.Popen[str]]) -> None:
    server = detach_server(start_daemon, native_build, tmp_path)
    tenant = start_tenant(cuda_programs, server, 2048, clients)
    lease_id = the_lease(server)["id"]
    # Nobody waits: the idle tenant keeps its GPU (policy when-queued).
    time.sleep(1.5)
    view = server.get_json(f"/api/v1/leases/{lease_id}")
    assert view["detach"]["state"] == "attached" and view["gpu"] == 0, view
    other = start_client(server, hold_gpu, 256 * MIB, 200, seed=77)
    clients.append(other)
    f = finish(other, "the waiting client")
    assert f["nonzero_before"] == "0" and f["exact"] == "1"  # none of the tenant's bytes
    view = server.get_json(f"/api/v1/leases/{lease_id}")
    assert view["detach"]["state"] == "detached" and view["gpu"] is None, view
    assert view["detach"]["saved_bytes"] >= 2048 * MIB and view["detach"]["detaches"] == 1
    out = resume(tenant, server)
    print(out)
    wait_until("the lease ended", lambda: not server.get_json("/api/v1/leases?state=active")["leases"])
    # (the scrub after its end: its detach's scrub stopped counting when it came back)
    wait_until("its GPU scrubbed", lambda: lease_of(server, lease_id)["scrub_ok"] is not None)
    rec = server.get_json(f"/api/v1/leases/{lease_id}")
    assert rec["detaches"] == 1 and rec["detached_s"] > 0 and rec["scrub_ok"] is True, rec
    states = [e["state"] for e in rec["events"]]
    assert states == ["detached", "attached"], rec["events"]
    metrics = scrape(server)
    assert metrics["gpupool_lease_detaches_total"] == 1
    assert metrics['gpupool_lease_reattaches_total{moved="no"}'] == 1
    assert metrics["gpupool_lease_reattach_seconds_count"] == 1
    assert metrics["gpupool_detached_bytes"] == 0 and metrics["gpupool_leases_detached"] == 0


def scrape(server: GpupoolServer) -> dict[str, float]:
    """The daemon's /metrics as {series: value}."""
    req = urllib.request.Request(server.http_url + "/metrics",
                                 headers={"Authorization": f"Bearer {server.admin_token}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        text = resp.read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


@pytest.mark.san  # the worker's parking and the sim's checkpoint under ASan/UBSan
def test_a_detached_lease_comes_back_on_the_other_gpu_when_its_own_is_taken(
        start_daemon: Any, native_build: Path, cuda_programs: Any, hold_gpu: Path,  # noqa: F811
        tmp_path: Path, clients: list[subprocess.Popen[str]]) -> None:
    server = detach_server(start_daemon, native_build, tmp_path, gpus=2, detach_policy="always")
    tenant = start_tenant(cuda_programs, server, 256, clients)
    lease_id = the_lease(server)["id"]
    wait_until("detached", lambda: server.get_json(f"/api/v1/leases/{lease_id}")["detach"]["state"]
               == "detached", timeout=20)
    wait_until("both GPUs free", lambda: gpu_states(server) == ["free", "free"])
    # The holder keeps its GPU: under "always" it would itself be detached whenever it idles
    # 0.5 s, which a loaded machine makes happen while it fills its buffer; it then came back on
    # GPU 1 (its own was being scrubbed) and the check below saw [False, True] (CI, 2026-12-06).
    holder = start_client(server, hold_gpu, 16 * MIB, 8000, seed=5, env={"GPUPOOL_KEEP_GPU": "1"})
    clients.append(holder)
    assert holder.stdout is not None and "holding" in holder.stdout.readline()
    assert [g["lease"] is not None for g in server.get_json("/api/v1/gpus")["gpus"]] == [True, False]
    resume(tenant, server)
    rec = server.get_json(f"/api/v1/leases/{lease_id}")
    attached = [e for e in rec["events"] if e["state"] == "attached"]
    assert attached and attached[-1]["gpu"] == 1 and "moved from GPU 0" in attached[-1]["detail"]
    finish(holder, "the holder")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in \
        Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]


def detached(server: GpupoolServer, lease_id: int) -> bool:
    return server.get_json(f"/api/v1/leases/{lease_id}").get("detach", {}).get("state") == \
        "detached"


@pytest.mark.san  # the worker's parking and the sim's checkpoint under ASan/UBSan
def test_no_detach_lands_in_the_middle_of_a_long_kernel(
        start_daemon: Any, native_build: Path, cuda_programs: Any, hold_gpu: Path,  # noqa: F811
        tmp_path: Path, clients: list[subprocess.Popen[str]]) -> None:
    server = detach_server(start_daemon, native_build, tmp_path)
    tenant = start_tenant(cuda_programs, server, 64, clients, "3000", first="spinning")
    assert tenant.stdout is not None
    # Someone waits the whole time the 3 s kernel runs, asking every 0.5 s (idle_detach_after).
    other = start_client(server, hold_gpu, 16 * MIB, 100, seed=8)
    clients.append(other)
    spun = tenant.stdout.readline()
    assert spun.startswith("spun at="), spun
    assert tenant.stdout.readline().startswith("ready")
    f = finish(other, "the waiting client")
    assert float(f["t_leased"]) >= float(spun.split("=")[1]), (f, spun)
    resume(tenant, server)


def test_a_client_that_keeps_its_gpu_is_never_detached_and_the_api_says_why(
        start_daemon: Any, native_build: Path, cuda_programs: Any, hold_gpu: Path,  # noqa: F811
        tmp_path: Path, clients: list[subprocess.Popen[str]]) -> None:
    server = detach_server(start_daemon, native_build, tmp_path, detach_policy="always")
    tenant = start_tenant(cuda_programs, server, 64, clients, env={"GPUPOOL_KEEP_GPU": "1"})
    other = start_client(server, hold_gpu, 16 * MIB, 100, seed=9)
    clients.append(other)
    time.sleep(2.5)  # five times idle_detach_after
    lease = the_lease(server)
    assert lease["gpu"] == 0 and lease["detach"]["state"] == "attached", lease
    assert "GPUPOOL_KEEP_GPU" in (lease["detach"]["keep_gpu"] or ""), lease
    assert len(server.get_json("/api/v1/queue")["queue"]) == 1 and other.poll() is None
    resume(tenant, server)
    finish(other, "the waiting client")


@pytest.mark.san  # the worker's parking and the sim's checkpoint under ASan/UBSan
def test_a_detached_client_killed_frees_its_saved_state_at_once(
        start_daemon: Any, native_build: Path, cuda_programs: Any,  # noqa: F811
        tmp_path: Path, clients: list[subprocess.Popen[str]]) -> None:
    server, tenant, lease = detached_tenant(start_daemon, native_build, cuda_programs, tmp_path,
                                            clients, 256)
    assert server.get_json("/api/v1/status")["detached_bytes"] >= 256 * MIB
    worker = lease["worker_pid"]
    tenant.kill()
    killed = time.monotonic()
    wait_until("the worker gone", lambda: not alive(worker), timeout=3)
    assert time.monotonic() - killed < 3
    wait_until("the lease ended", lambda: not server.get_json("/api/v1/leases?state=active")["leases"])
    rec = server.get_json(f"/api/v1/leases/{lease['id']}")
    assert rec["end_reason"] == "client lost" and rec["detaches"] == 1, rec
    assert server.get_json("/api/v1/status")["detached_bytes"] == 0


@pytest.mark.san  # the worker's parking and the sim's checkpoint under ASan/UBSan
def test_gpupoold_killed_with_a_detached_lease_is_taken_over_and_leaves_nothing_behind(
        start_daemon: Any, native_build: Path, cuda_programs: Any,  # noqa: F811
        tmp_path: Path, clients: list[subprocess.Popen[str]]) -> None:
    server, tenant, lease = detached_tenant(start_daemon, native_build, cuda_programs, tmp_path,
                                            clients, 128)
    worker = lease["worker_pid"]
    server.kill_daemon_only()
    # The client calls while no gpupoold runs: its worker, parked, holds the call (keepalive
    # notices) and tells the next gpupoold at once (worker_wants_gpu after worker_adopted).
    assert tenant.stdin is not None
    tenant.stdin.write("go\n")
    tenant.stdin.flush()
    time.sleep(1.0)
    assert alive(worker) and tenant.poll() is None
    again = start_daemon("--simulated", "1", "--config", str(tmp_path / "gpupoold.toml"),
                         build_dir=native_build, simulated=None, state_dir=server.state_dir)
    out, err = tenant.communicate(timeout=120)  # every byte as it was
    assert tenant.returncode == 0 and "PASS detach" in out, f"{out}\n{err}\n{again.log_text()}"
    assert f"lease {lease['id']} taken over detached (from GPU 0" in again.log_text()
    wait_until("the lease ended", lambda: lease_of(again, lease["id"]).get("ended") is not None)
    rec = lease_of(again, lease["id"])
    assert rec["end_reason"] == "client exit", rec
    wait_until("its GPU scrubbed", lambda: lease_of(again, lease["id"])["scrub_ok"] is True)
    left = sorted(p.name for p in (server.state_dir / "workers").iterdir()
                  if p.name.startswith("lease-"))
    assert left == [], left


def test_a_pytorch_program_carries_on_with_identical_tensors_after_a_detach(
        start_daemon: Any, native_build: Path, hold_gpu: Path,  # noqa: F811
        tmp_path: Path, clients: list[subprocess.Popen[str]]) -> None:
    require(importlib.util.find_spec("torch") is not None,
            f"torch is not installed in {sys.executable}")
    server = detach_server(start_daemon, native_build, tmp_path)
    script = REPO / "tests" / "torch_scripts" / "idle_detach.py"
    tenant = subprocess.Popen([sys.executable, str(script)], env=server.client_env(),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    clients.append(tenant)
    assert tenant.stdout is not None
    line = tenant.stdout.readline()
    assert line.startswith("ready"), f"{line}{tenant.stderr.read() if tenant.stderr else ''}"
    lease_id = the_lease(server)["id"]
    other = start_client(server, hold_gpu, 64 * MIB, 200, seed=11)
    clients.append(other)
    f = finish(other, "the waiting client")
    assert f["nonzero_before"] == "0" and f["exact"] == "1"
    assert detached(server, lease_id)
    out, err = tenant.communicate("go\n", timeout=300)
    assert tenant.returncode == 0 and "PASS idle_detach" in out, f"{out}\n{err}"
    rec = server.get_json(f"/api/v1/leases/{lease_id}")
    assert rec["detaches"] == 1 and [e["state"] for e in rec["events"]] == ["detached", "attached"]


def stop_detached(server: GpupoolServer, lease: dict[str, Any]) -> None:
    """`systemctl restart`, first half: SIGTERM once the lease's detach is recorded; the lease
    continues without gpupoold, detached (LeaseManager.close), its worker parked."""
    lease_id = lease["id"]
    wait_until("its detach recorded", lambda: [e["state"] for e in lease_of(server, lease_id)
                                               ["events"]] == ["detached"])
    assert server.stop() == 0, server.log_text()[-3000:]
    assert alive(lease["worker_pid"]), "the detached lease's worker ended with gpupoold"
    assert f"lease {lease_id} detached from GPU 0 (worker pid" in server.log_text()


def test_a_detached_lease_survives_a_daemon_restart_and_comes_back_bit_exact(
        start_daemon: Any, native_build: Path, cuda_programs: Any, tmp_path: Path,  # noqa: F811
        clients: list[subprocess.Popen[str]]) -> None:
    """SIGTERM, start on the same state directory, then the client's next call. (A call made
    while no gpupoold runs: test_gpupoold_killed_with_a_detached_lease_...)"""
    server, tenant, lease = detached_tenant(start_daemon, native_build, cuda_programs, tmp_path,
                                            clients, 64)
    lease_id = lease["id"]
    restarted_at = time.time()
    stop_detached(server, lease)
    again = start_daemon("--simulated", "1", "--config", str(tmp_path / "gpupoold.toml"),
                         build_dir=native_build, simulated=None, state_dir=server.state_dir)
    wait_until("taken over detached", lambda: detached(again, lease_id), timeout=20)
    wait_until("its GPU free meanwhile", lambda: gpu_states(again) == ["free"])
    print(resume(tenant, again))  # detach.cu checks every byte, stream, event, graph
    wait_until("the lease ended", lambda: lease_of(again, lease_id).get("ended") is not None)
    rec = lease_of(again, lease_id)
    # One lease, not ended and started again: its record spans the restart.
    assert rec["end_reason"] == "client exit", rec
    assert rec["started"] < restarted_at < rec["ended"], rec
    assert [e["state"] for e in rec["events"]][:2] == ["detached", "attached"], rec["events"]
    mine = [r for r in again.get_json("/api/v1/leases?state=all")["leases"]
            if r["client_pid"] == tenant.pid]
    assert [r["id"] for r in mine] == [lease_id], mine
    log = again.log_text()
    assert f"lease {lease_id} taken over detached (from GPU 0" in log
    assert f"lease {lease_id} attached again on GPU 0" in log


def test_a_lease_that_came_back_on_the_other_gpu_survives_a_daemon_restart_there(
        start_daemon: Any, native_build: Path, cuda_programs: Any, hold_gpu: Path,  # noqa: F811
        tmp_path: Path, clients: list[subprocess.Popen[str]]) -> None:
    """Idle detach moved the lease from GPU 0 to GPU 1; its record still says GPU 0 (the GPU it
    started on: the history's first stretch). A restart must take it over on GPU 1, where it
    runs, not end it ("runs on ..., not on GPU 0"); and GPU 0's own lease must stay too."""
    server = detach_server(start_daemon, native_build, tmp_path, gpus=2)  # when-queued
    tenant = start_tenant(cuda_programs, server, 64, clients, "0", "1")
    lease_id = the_lease(server)["id"]
    # GPU 1 taken, then a waiter: the idle tenant gives GPU 0 to it. Both keep their GPUs.
    keep = {"GPUPOOL_KEEP_GPU": "1"}
    blocker = start_client(server, hold_gpu, 16 * MIB, 60000, seed=3, env=keep)
    clients.append(blocker)
    assert blocker.stdout is not None and "holding" in blocker.stdout.readline()
    other = start_client(server, hold_gpu, 32 * MIB, 6000, seed=4, env=keep)
    clients.append(other)
    assert other.stdout is not None and "holding" in other.stdout.readline()
    assert detached(server, lease_id)
    # Its client calls; GPU 1 comes free: the tenant comes back there, and idles.
    assert tenant.stdin is not None and tenant.stdout is not None
    tenant.stdin.write("go\n")
    tenant.stdin.flush()
    blocker.kill()
    assert tenant.stdout.readline().startswith("back")
    wait_until("its move recorded", lambda: [(e["state"], e["gpu"]) for e in lease_of(
        server, lease_id)["events"]] == [("detached", 0), ("attached", 1)])
    restarted_at = time.time()
    assert server.stop() == 0, server.log_text()[-3000:]
    again = start_daemon("--simulated", "2", "--config", str(tmp_path / "gpupoold.toml"),
                         build_dir=native_build, simulated=None, state_dir=server.state_dir)
    wait_until("taken over (or ended)", lambda: lease_of(again, lease_id).get("gpu") == 1
               or lease_of(again, lease_id).get("ended") is not None, timeout=20)
    view = lease_of(again, lease_id)
    assert view.get("ended") is None and view["gpu"] == 1, (view.get("end_detail"), view)
    out, err = tenant.communicate("go\n", timeout=120)  # every byte as it was
    assert tenant.returncode == 0 and "PASS detach" in out, f"{out}\n{err}\n{again.log_text()}"
    assert finish(other, "the client on GPU 0")["exact"] == "1"
    wait_until("the lease ended", lambda: lease_of(again, lease_id).get("ended") is not None)
    rec = lease_of(again, lease_id)
    assert rec["end_reason"] == "client exit" and rec["started"] < restarted_at < rec["ended"], rec
    assert rec["gpu_index"] == 0, rec  # where it started; the events say where it went
    mine = [r["id"] for r in again.get_json("/api/v1/leases?state=all")["leases"]
            if r["client_pid"] == tenant.pid]
    assert mine == [lease_id], mine
    assert f"lease {lease_id} taken over: GPU 1" in again.log_text()


def test_a_detached_lease_whose_worker_died_during_the_restart_ends_with_a_message(
        start_daemon: Any, native_build: Path, cuda_programs: Any, tmp_path: Path,  # noqa: F811
        clients: list[subprocess.Popen[str]]) -> None:
    server, tenant, lease = detached_tenant(start_daemon, native_build, cuda_programs, tmp_path,
                                            clients, 16)
    lease_id = lease["id"]
    stop_detached(server, lease)
    os.kill(lease["worker_pid"], 9)  # it crashed while no gpupoold followed it
    wait_until("the worker gone", lambda: not alive(lease["worker_pid"]))
    again = start_daemon("--simulated", "1", "--config", str(tmp_path / "gpupoold.toml"),
                         build_dir=native_build, simulated=None, state_dir=server.state_dir)
    wait_until("the lease ended", lambda: lease_of(again, lease_id).get("ended") is not None)
    rec = lease_of(again, lease_id)
    assert rec["end_reason"] == "daemon lost" and "worker is gone" in rec["end_detail"], rec
    assert not again.get_json("/api/v1/leases?state=active")["leases"]
    wait_until("its GPU free", lambda: gpu_states(again) == ["free"])
    out, err = tenant.communicate("go\n", timeout=60)
    assert tenant.returncode != 0 and "PASS" not in out
    assert "gpupool: lost connection to server" in err, err  # what happened, from the shim
