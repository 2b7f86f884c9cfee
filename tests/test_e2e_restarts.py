"""End to end: leases outlive gpupoold. A job streaming copies and a job sitting idle both finish
correctly while their daemon is stopped (SIGTERM), killed (SIGKILL) and started again; the new
daemon takes their leases over (worker/adopt.c, LeaseManager.start) and gives their GPUs to
nobody else meanwhile; the history shows one unbroken lease each. A worker whose daemon never
comes back ends its lease after `worker_orphan_grace`, and the GPU is scrubbed before anyone
else gets it. Real gpupoold, real workers, real clients (tests/clients/hold_gpu.c) on simulated
GPUs.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import GpupoolServer
from test_e2e_leases import MIB, ended_leases, facts, gpu_states, hold_gpu, start_client, wait_until  # noqa: F401

from gpupoold.workers import control

GIB = 1 << 30


def active_ids(server: GpupoolServer) -> set[int]:
    return {le["id"] for le in server.get_json("/api/v1/leases?state=active")["leases"]}


def finish(proc: subprocess.Popen[str], what: str, timeout: float = 120) -> dict[str, str]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"{what} failed ({proc.returncode}):\n{out}\n{err}"
    f = facts(out)
    assert f["exact"] == "1", f"{what}: data not bit-exact: {out}"
    return f


def restart(start_daemon: Any, server: GpupoolServer, how: str, *extra: str) -> GpupoolServer:
    if how == "sigterm":
        assert server.stop() == 0, server.log_text()[-3000:]
        assert "lease(s) continue without gpupoold" in server.log_text()
    else:
        server.kill_daemon_only()
    time.sleep(0.5)  # the clients go on with no daemon at all for a moment
    return start_daemon("--simulated", "2", *extra, build_dir=server.build_dir, simulated=None,
                        state_dir=server.state_dir)


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_a_streaming_and_an_idle_lease_survive_a_daemon_restart(
        start_daemon: Any, native_build: Path, hold_gpu: Path, how: str,  # noqa: F811
        clients: list[subprocess.Popen[str]]) -> None:
    server = start_daemon("--simulated", "2", build_dir=native_build, simulated=None)
    wait_until("both GPUs free", lambda: gpu_states(server) == ["free", "free"])
    # Each holds its GPU for 12 s once it has set up (1 GiB takes a few seconds here).
    streaming = start_client(server, hold_gpu, GIB, 12_000, seed=31, loops=-1)
    clients.append(streaming)
    assert streaming.stdout is not None and "holding" in streaming.stdout.readline()
    idle = start_client(server, hold_gpu, 16 * MIB, 12_000, seed=32)
    clients.append(idle)
    assert idle.stdout is not None and "holding" in idle.stdout.readline()
    leases = active_ids(server)
    assert len(leases) == 2

    restarted_at = time.time()
    again = restart(start_daemon, server, how)
    # Taken over, both GPUs still theirs: a newcomer waits in the queue.
    wait_until("the leases taken over", lambda: active_ids(again) == leases, timeout=20)
    assert gpu_states(again) == ["leased", "leased"]
    newcomer = start_client(again, hold_gpu, MIB, 0, seed=33)
    clients.append(newcomer)
    time.sleep(1.0)
    assert newcomer.poll() is None and active_ids(again) == leases, "a held GPU was given away"

    s, i = finish(streaming, "the streaming client"), finish(idle, "the idle client")
    assert int(s["copies"]) > 0
    n = finish(newcomer, "the client that waited")
    assert float(n["t_leased"]) >= min(float(s["t_end"]), float(i["t_end"])) - 0.5

    wait_until("three leases ended and scrubbed after",
               lambda: [r["scrub_ok"] is not None for r in ended_leases(again)] == [True] * 3,
               timeout=20)
    records = {r["id"]: r for r in ended_leases(again)}
    for lease_id in leases:  # one unbroken lease each: one record, ended by its client
        rec = records[lease_id]
        assert rec["end_reason"] == "client exit", rec
        assert rec["scrub_ok"] is True, rec
        assert rec["started"] < restarted_at < rec["ended"], rec
    streamed = next(records[i] for i in leases if records[i]["bytes_d2h"] > GIB)
    assert streamed["bytes_d2h"] >= (int(s["copies"]) + 2) * GIB  # counted across the restart
    log = again.log_text()
    assert "taking over 2 lease(s) of the previous gpupoold" in log
    assert "adopted by gpupoold pid" in log  # the workers' lines reach the new daemon's log
    wait_until("both GPUs free", lambda: gpu_states(again) == ["free", "free"])


def test_a_worker_whose_daemon_never_returns_ends_after_the_grace(
        start_daemon: Any, native_build: Path, hold_gpu: Path, tmp_path: Path,  # noqa: F811
        clients: list[subprocess.Popen[str]]) -> None:
    config = tmp_path / "gpupoold.toml"
    config.write_text("worker_orphan_grace = 1.5\n")
    server = start_daemon("--simulated", "2", "--config", str(config), build_dir=native_build,
                          simulated=None)
    wait_until("both GPUs free", lambda: gpu_states(server) == ["free", "free"])
    client = start_client(server, hold_gpu, 8 * MIB, 8_000, seed=41)
    clients.append(client)
    assert client.stdout is not None and "holding" in client.stdout.readline()
    (lease_id,) = active_ids(server)
    server.kill_daemon_only()
    t0 = time.monotonic()
    end = server.state_dir / "workers" / f"lease-{lease_id}.end"
    wait_until("the worker's end record", end.exists, timeout=10, interval=0.05)
    waited = time.monotonic() - t0
    assert 1.4 <= waited < 6, waited
    assert control.decode(end.read_bytes()).reason == "daemon lost"
    # The idle client learns it at once (its shim prints the notice) and fails at its next call.
    out, err = client.communicate(timeout=30)
    assert client.returncode != 0
    assert "the gpupool server has been gone for 1.5 s" in err, err
    assert not (server.state_dir / "workers" / f"lease-{lease_id}.sock").exists()

    again = start_daemon("--simulated", "2", "--config", str(config), build_dir=native_build,
                         simulated=None, state_dir=server.state_dir)
    wait_until("both GPUs scrubbed and free", lambda: gpu_states(again) == ["free", "free"])
    rec = next(r for r in ended_leases(again) if r["id"] == lease_id)
    assert rec["end_reason"] == "daemon lost", rec
    assert "worker_orphan_grace" in rec["end_detail"], rec
    assert rec["scrub_ok"] is True and rec["bytes_h2d"] >= 8 * MIB, rec
    assert not end.exists()
    # Nothing of the tenant is left for the next one.
    nxt = subprocess.run([str(hold_gpu), str(8 * MIB), "0", "42"], env=again.client_env(),
                         capture_output=True, text=True, timeout=60)
    assert nxt.returncode == 0, nxt.stderr
    assert facts(nxt.stdout)["nonzero_before"] == "0"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_clients_waiting_or_arriving_during_a_restart_are_served(
        start_daemon: Any, native_build: Path, hold_gpu: Path,  # noqa: F811
        clients: list[subprocess.Popen[str]]) -> None:
    """A client waiting in the queue when gpupoold restarts is told so (GP_ESHUTDOWN) and comes
    back by itself; one that connects while no gpupoold listens retries for a few seconds. Both
    get the GPU from the new daemon once the holder (its lease taken over) is done."""
    listen = f"127.0.0.1:{free_port()}"
    server = start_daemon("--simulated", "1", "--listen", listen, build_dir=native_build,
                          simulated=None)
    wait_until("the GPU free", lambda: gpu_states(server) == ["free"])
    holder = start_client(server, hold_gpu, MIB, 6_000, seed=71)
    clients.append(holder)
    assert holder.stdout is not None and "holding" in holder.stdout.readline()
    queued = start_client(server, hold_gpu, MIB, 0, seed=72)
    clients.append(queued)
    wait_until("the second client queued",
               lambda: len(server.get_json("/api/v1/queue")["queue"]) == 1)
    assert server.stop() == 0
    late = start_client(server, hold_gpu, MIB, 0, seed=73)  # nobody listens now
    clients.append(late)
    time.sleep(0.5)
    again = start_daemon("--simulated", "1", "--listen", listen, build_dir=native_build,
                         simulated=None, state_dir=server.state_dir)
    out, err = queued.communicate(timeout=120)
    assert queued.returncode == 0 and "exact=1" in out, (out, err)
    assert "the server is stopping or restarting; trying again for up to 10 s" in err, err
    out, err = late.communicate(timeout=120)
    assert late.returncode == 0 and "exact=1" in out, (out, err)
    assert "Connection refused" not in err, err  # retried quietly, then served
    finish(holder, "the holder")
    records = wait_until("three leases ended", lambda: (
        r if len(r := ended_leases(again)) == 3 else None))
    assert {r["end_reason"] for r in records} == {"client exit"}, records


def test_a_lease_that_cannot_be_taken_over_ends_and_its_gpu_is_scrubbed(
        start_daemon: Any, native_build: Path, hold_gpu: Path,  # noqa: F811
        clients: list[subprocess.Popen[str]]) -> None:
    """The record of a running lease no longer matches its GPU (corrupt state, or the GPU was
    replaced while gpupoold was down): the new daemon does not adopt the worker, tells it to
    end (the client hears why), closes the record, and scrubs the GPU before the next tenant."""
    import sqlite3

    server = start_daemon("--simulated", "1", build_dir=native_build, simulated=None)
    wait_until("the GPU free", lambda: gpu_states(server) == ["free"])
    # Idle (no call in flight), so that the worker's last notice reaches it; it fails at its
    # next call, when its 6 s are over.
    client = start_client(server, hold_gpu, 8 * MIB, 6_000, seed=81)
    clients.append(client)
    assert client.stdout is not None and "holding" in client.stdout.readline()
    (lease_id,) = active_ids(server)
    assert server.stop() == 0
    db = sqlite3.connect(server.state_dir / "gpupoold.db")
    with db:
        db.execute("UPDATE leases SET gpu_uuid = 'GPU-00000000-dead-beef-0000-000000000000' "
                   "WHERE id = ?", (lease_id,))
    db.close()
    again = start_daemon("--simulated", "1", build_dir=native_build, simulated=None,
                         state_dir=server.state_dir)
    out, err = client.communicate(timeout=60)
    assert client.returncode != 0
    assert "could not take over this session after a restart" in err, err
    wait_until("the GPU scrubbed and free", lambda: gpu_states(again) == ["free"], timeout=30)
    rec = next(r for r in ended_leases(again) if r["id"] == lease_id)
    # The worker's own account of its end (its end record: told to end by the new daemon).
    assert rec["end_reason"] == "server ended", rec
    assert "could not take over this session after a restart" in rec["end_detail"], rec
    assert "its GPU is not served any more" in again.log_text()
    nxt = subprocess.run([str(hold_gpu), str(8 * MIB), "0", "82"], env=again.client_env(),
                         capture_output=True, text=True, timeout=60)
    assert nxt.returncode == 0 and facts(nxt.stdout)["nonzero_before"] == "0", nxt.stderr
