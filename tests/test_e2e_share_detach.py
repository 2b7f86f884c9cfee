"""End to end (issue 32, item 5): idle detach of a share. gpupoold --simulated 1 with `share = 2`,
real clients (tests/clients/hold_gpu.c through the shim), gpupool-checkpoint and the simulated
GPU's shared allocator.

- Share A idles while shares B (GPUPOOL_KEEP_GPU=1) and A fill the GPU's two places and a third
  share C waits: A detaches, C lands in its place with no whole scrub between and reads only
  zeros where A's bytes were (the checkpoint zeroed what A gave back), the GPU's share list names
  B and C only, and A, whose client calls again while C holds the place, waits for it and comes
  back on the same GPU, every byte intact.
- A whole-GPU client waits behind two idle shares: they are asked to detach at once (not after
  idle_detach_after), the GPU is scrubbed whole and the whole-GPU lease runs while the shares'
  clients still hold their data; both come back intact after it.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from conftest import GpupoolServer
from test_e2e_leases import MIB, facts, gpu_states, hold_gpu, start_client, wait_until  # noqa: F401

SIZE = 32 * MIB
SHARE = {"GPUPOOL_MEMORY": "8GiB"}
KEEP = {**SHARE, "GPUPOOL_KEEP_GPU": "1"}


def holding(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None and "holding" in proc.stdout.readline()


def finish(proc: subprocess.Popen[str], what: str, server: GpupoolServer) -> dict[str, str]:
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, f"{what} failed ({proc.returncode}):\n{out}\n{err}\n" \
                                 f"{server.log_text()[-3000:]}"
    return facts(out)


def lease_of(server: GpupoolServer, pid: int) -> dict[str, Any]:
    leases = server.get_json("/api/v1/leases?state=active")["leases"]
    found = [le for le in leases if le["client"]["pid"] == pid]
    assert found, f"no active lease of client {pid}: {leases}"
    return found[0]


def share_pids(server: GpupoolServer) -> set[int]:
    (gpu,) = server.get_json("/api/v1/gpus")["gpus"]
    return {s["client"]["pid"] for s in gpu["shares"]["leases"]}


def test_an_idle_share_leaves_its_place_and_a_whole_gpu_request_drains_the_shares(
        start_daemon: Any, native_build: Path, hold_gpu: Path, tmp_path: Path,  # noqa: F811
        clients: list[subprocess.Popen[str]]) -> None:
    conf = tmp_path / "gpupoold.toml"
    conf.write_text("share = 2\nsim_memory_gib = 16\nidle_detach_after = 1.5\n")
    server = start_daemon("--simulated", "1", "--config", str(conf), build_dir=native_build,
                          simulated=None)
    wait_until("GPU 0 free", lambda: gpu_states(server) == ["free"], timeout=30)

    a = start_client(server, hold_gpu, SIZE, 2500, seed=51, env=SHARE)
    clients.append(a)
    holding(a)
    b = start_client(server, hold_gpu, SIZE, 60_000, seed=52, env=KEEP)
    clients.append(b)
    holding(b)
    scrubs = server.log_text().count("GPU 0 clean")
    a_id = lease_of(server, a.pid)["id"]
    c = start_client(server, hold_gpu, SIZE, 3000, seed=53, env=KEEP)  # no place: it waits
    clients.append(c)
    holding(c)  # in A's place: A detached
    assert share_pids(server) == {b.pid, c.pid}
    view = server.get_json(f"/api/v1/leases/{a_id}")
    assert view["detach"]["state"] in ("detached", "attaching") and view["gpu"] is None, view
    fc = finish(c, "the share in A's place", server)
    assert fc["nonzero_before"] == "0" and fc["exact"] == "1", fc  # A's bytes zeroed as it left
    fa = finish(a, "the detached share", server)  # back once C's place was free
    assert fa["exact"] == "1", fa
    logged = server.log_text()
    assert f"lease {a_id} detached from GPU 0 (a share)" in logged, logged[-3000:]
    assert f"lease {a_id} attached again on GPU 0, " in logged, logged[-3000:]
    assert logged.count("GPU 0 clean") == scrubs, "a whole scrub ran while B held its share"
    b.kill()
    b.communicate(timeout=10)
    wait_until("GPU 0 free again", lambda: gpu_states(server) == ["free"], timeout=30)

    s1 = start_client(server, hold_gpu, SIZE, 4000, seed=61, env=SHARE)
    clients.append(s1)
    holding(s1)
    s2 = start_client(server, hold_gpu, SIZE, 4000, seed=62, env=SHARE)
    clients.append(s2)
    holding(s2)
    ids = {lease_of(server, p.pid)["id"] for p in (s1, s2)}
    whole = start_client(server, hold_gpu, SIZE, 300, seed=63)
    clients.append(whole)
    fw = finish(whole, "the whole-GPU client", server)
    assert fw["nonzero_before"] == "0" and fw["exact"] == "1", fw
    assert s1.poll() is None and s2.poll() is None  # it ran while they still held their data
    logged = server.log_text()
    early = [logged.find(f"lease {i} detached from GPU 0 (a share, asked early") for i in ids]
    assert min(early) >= 0, logged[-3000:]
    assert logged.find("GPU 0 clean", max(early)) > 0, "no whole scrub after the shares left"
    for proc in (s1, s2):
        f = finish(proc, "a drained share", server)
        assert f["exact"] == "1", f
