"""`gpupool status` and `gpupool smi` show a shared GPU's shares (issue 32, item 6) and a lease of
several GPUs on each of its GPUs (issue 37, item 6), from the info reply's protocol 1.7 records
(shared_gpus, share_views, lease_gpus). Unit tests on a reply encoded and decoded as the wire
carries it, the records gpupoold builds from its views, and one end-to-end run through gpupoold
--simulated with `share = 2` on GPU 0 and a 2-GPU lease on GPUs 1 and 2."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import gpupool_protocol as gp
import pytest
from conftest import REPO, run_client, wait_until
from test_e2e_leases import hold_gpu, start_client  # noqa: F401 (hold_gpu is a fixture)

sys.path.insert(0, str(REPO / "client"))

from gpupool.config import ServerConfig  # noqa: E402
from gpupool.probe import Probe  # noqa: E402
from gpupool.status import _holder, _smi_state, print_smi, print_status, smi_json  # noqa: E402
from gpupool.wire.info import InfoResult, decode_reply, document  # noqa: E402

from gpupoold.remoting.info import lease_gpu_records, shared_records  # noqa: E402

GIB = 1 << 30
MIB = 1 << 20


def _gpu(index: int, state: str, lease_id: int = 0) -> gp.InfoGpu:
    return gp.InfoGpu(index=index, name="Sim GPU", uuid=f"GPU-{index}", simulated=1,
                      memory_total=16 * GIB, state=state, lease_id=lease_id, live_at=1.0,
                      live_memory_total=16 * GIB, memory_used=GIB, memory_free=15 * GIB,
                      gpu_util=3, memory_util=1, temperature_c=40, power_w=80.0,
                      power_limit_w=700.0, energy_j=1.0, sm_clock_mhz=1, mem_clock_mhz=1,
                      cuda_driver_version=13000)


def _lease(lease_id: int, gpu: int, token: str, pid: int, mine: bool, who: str = "ada@laptop",
           ) -> gp.InfoLease:
    user, host = who.split("@")
    return gp.InfoLease(id=lease_id, gpu=gpu, token=token, client_host=host,
                        client_user=user, client_pid=pid, client_program="train.py",
                        request="any GPU", started=1.0, duration_s=12.0, queued_s=0.0,
                        worker_pid=1, mine=int(mine))


def a_reply(with_17: bool = True) -> gp.InfoReply:
    """GPU 0 shared (2 shares at most) by lease 4 (mine) and lease 5 (bob's); lease 6 (mine) on
    GPUs 1 and 2; GPU 3 free. with_17=False: the same as a 1.6 server says it."""
    extra: dict[str, Any] = {}
    if with_17:
        extra = dict(
            shared_gpus=[gp.InfoSharedGpu(gpu=0, max_shares=2, shares=2, closed=0)],
            share_views=[
                gp.InfoShare(gpu=0, lease_id=4, memory_quota=4 * GIB, memory_used=512 * MIB,
                             busy_s=1.25),
                gp.InfoShare(gpu=0, lease_id=5, memory_quota=8 * GIB, memory_used=GIB,
                             busy_s=0.5)],
            lease_gpus=[gp.InfoLeaseGpu(lease_id=4, gpu=0), gp.InfoLeaseGpu(lease_id=5, gpu=0),
                        gp.InfoLeaseGpu(lease_id=6, gpu=1), gp.InfoLeaseGpu(lease_id=6, gpu=2)])
    return gp.InfoReply(
        result=0, major=gp.MAJOR, minor=gp.MINOR if with_17 else 6, server="gpupoold 0.1.0",
        gpus=4, you_name="tests", you_role="user", time=1.0,
        gpu_views=[_gpu(0, "leased"), _gpu(1, "leased", 6), _gpu(2, "leased", 6),
                   _gpu(3, "free")],
        lease_views=[_lease(4, 0, "tests", 40, True), _lease(5, 0, "bob", 50, False, "bo@desk"),
                     _lease(6, 1, "tests", 60, True)], **extra)


def a_probe(reply: gp.InfoReply) -> Probe:
    body = reply.encode()
    if reply.minor < 7:  # a 1.6 server's reply ends before the three 1.7 arrays
        body = body[:-12]
    got = decode_reply(body)
    info = InfoResult(result=0, message="", major=got.major, minor=got.minor, server=got.server,
                      gpus=got.gpus, matching=0, free_matching=0, queue=0, data=document(got))
    return Probe(server=ServerConfig(address="gpu1:7070", host="gpu1", port="7070"), info=info)


def test_status_shows_the_shares_and_each_gpu_of_a_lease(capsys: pytest.CaptureFixture[str],
                                                         ) -> None:
    print_status([a_probe(a_reply())])
    out = capsys.readouterr().out
    assert re.search(r"^  0 +Sim GPU \[simulated\] +leased +2 of 2 shares \[me\] ", out, re.M), out
    for gpu in (1, 2):  # the 2-GPU lease on each of its GPUs
        assert re.search(rf"^  {gpu} +Sim GPU \[simulated\] +leased +tests \(ada@laptop\) \[me\], "
                         r"lease 6 on GPUs 1, 2 ", out, re.M), out
    assert re.search(r"^  3 +Sim GPU \[simulated\] +free +- ", out, re.M), out
    assert "  GPU 0 shares: 2 of 2\n" in out
    assert ("    lease 4: tests (ada@laptop) [me], 512 MiB of 4.0 GiB quota, 1.2 s GPU time\n"
            in out), out
    assert "    lease 5: bob (bo@desk), 1.0 GiB of 8.0 GiB quota, 0.5 s GPU time\n" in out, out
    assert re.search(r"^    lease 4 on GPU 0, a share of 4\.0 GiB: train\.py", out, re.M), out
    assert re.search(r"^    lease 6 on GPUs 1, 2: train\.py \(pid 60", out, re.M), out


def test_smi_lists_a_lease_on_each_gpu_and_every_share(capsys: pytest.CaptureFixture[str],
                                                       ) -> None:
    view = smi_json([a_probe(a_reply())])
    assert [(p["lease"], p["gpu"], p["used_memory"], p["memory_quota"])
            for p in view["processes"]] == [(4, 0, 512 * MIB, 4 * GIB), (6, 1, GIB, None),
                                             (6, 2, GIB, None)]
    assert [(s["gpu"], s["lease"], s["token"], s["mine"], s["memory_used"], s["memory_quota"])
            for s in view["shares"]] == [(0, 4, "tests", True, 512 * MIB, 4 * GIB),
                                         (0, 5, "bob", False, GIB, 8 * GIB)]
    assert view["gpus"][0]["shares"]["max"] == 2 and view["gpus"][3]["shares"] is None
    json.dumps(view)  # --json prints it
    print_smi(view)
    out = capsys.readouterr().out
    assert re.search(r"^\| gpu1:7070 \|   0 \| Sim GPU \[simulated\] \| leased \(2/2 shares\) \|",
                     out, re.M), out
    for gpu in (1, 2):
        assert re.search(rf"^\| gpu1:7070 \|   {gpu} \| +6 \| +60 \| laptop \| train\.py +\| "
                         r"+1024MiB \|$", out, re.M), out
    assert "Shares of shared GPUs:" in out
    assert re.search(r"^\| gpu1:7070 \|   0 \| +4 \| tests \(ada@laptop\) \[me\] \| +512MiB / "
                     r"4096MiB \| +1\.2s \|$", out, re.M), out
    assert re.search(r"^\| gpu1:7070 \|   0 \| +5 \| bob \(bo@desk\) +\| +1024MiB / 8192MiB \| "
                     r"+0\.5s \|$", out, re.M), out


def test_a_16_server_shows_what_it_says(capsys: pytest.CaptureFixture[str]) -> None:
    """A 1.6 server's reply has no shares and only each lease's first GPU: status shows the GPUs
    whose view names the lease, and no share lines."""
    probe = a_probe(a_reply(with_17=False))
    data = probe.info.data  # type: ignore[union-attr]
    assert [x["gpus"] for x in data["leases"]] == [[0], [0], [1, 2]]
    assert all(g["shares"] is None for g in data["gpus"])
    print_status([probe])
    out = capsys.readouterr().out
    assert "shares" not in out and re.search(r"^    lease 6 on GPUs 1, 2: ", out, re.M), out
    assert not smi_json([probe])["shares"]


def test_a_shared_gpu_leased_whole_names_its_holder() -> None:
    """A shared GPU without shares may be leased whole (a request without a memory size, after
    its shares drained): status names the lease's holder, smi does not count 0 shares."""
    lease = {"id": 7, "token": "alice", "client": {"user": "u", "host": "h", "pid": 3},
             "gpus": [0]}
    gpu = {"index": 0, "state": "leased", "lease": lease,
           "shares": {"max": 2, "closed": 1, "leases": []}}
    assert _holder(gpu, [lease], {7}).startswith("alice (") and "[me]" in _holder(gpu, [lease], {7})
    assert _smi_state(gpu) == "leased (whole)"
    free = {"index": 0, "state": "free", "lease": None,
            "shares": {"max": 2, "closed": 0, "leases": []}}
    assert _holder(free, [], set()) == "-" and _smi_state(free) == "free (0/2 shares)"


def test_the_daemon_builds_the_records_from_its_views() -> None:
    """remoting/info.py: shared_records from the GPU views' `shares` (None: not shared) and
    lease_gpu_records from each lease view's `gpus` (a detached lease has none)."""
    shares = {"max": 4, "closed": True, "kept_for_ticket": None, "granted": 0, "leases": [
        {"id": 9, "token": "t", "client": {"user": "u", "host": "h", "program": "secret --x"},
         "memory_quota": 8 * GIB, "memory_used": 3, "busy_s": 2.5}]}
    gpus, held = shared_records([{"index": 0, "shares": None}, {"index": 1, "shares": shares}])
    assert [(g.gpu, g.max_shares, g.shares, g.closed) for g in gpus] == [(1, 4, 1, 1)]
    assert [(s.gpu, s.lease_id, s.memory_quota, s.memory_used, s.busy_s) for s in held] == [
        (1, 9, 8 * GIB, 3, 2.5)]
    # Closed to new shares for any reason: kept for a whole-GPU request, drained; open else.
    def closed(shared: dict[str, Any], **view: Any) -> int:
        return shared_records([{"index": 0, "shares": shared, **view}])[0][0].closed

    open_ = {**shares, "closed": False}
    assert closed(open_, state="leased") == 0
    assert closed({**open_, "kept_for_ticket": 12}, state="leased") == 1
    assert closed(open_, state="leased", draining=True) == 1
    assert closed(open_, state="drained") == 1
    records = lease_gpu_records([{"id": 3, "gpus": [2, 0]}, {"id": 4, "gpus": []},
                                 {"id": 5, "gpus": [1]}])
    assert [(r.lease_id, r.gpu) for r in records] == [(3, 2), (3, 0), (5, 1)]


# ------------------------------------------------------------------------------- end to end
def test_status_and_smi_of_a_shared_gpu_and_a_two_gpu_lease(
        start_daemon: Any, native_build: Path, hold_gpu: Path, tmp_path: Path) -> None:  # noqa: F811
    config = tmp_path / "gpupoold.toml"
    config.write_text("share = 2\nshare_gpus = [0]\nsim_memory_gib = 16\n")
    server = start_daemon("--config", str(config), build_dir=native_build, simulated=3)
    wait_until("3 GPUs free", lambda: [g["state"] for g in server.get_json("/api/v1/gpus")["gpus"]]
               == ["free"] * 3, timeout=30)
    procs = [start_client(server, hold_gpu, 8 * MIB, 60_000, seed=i + 1,
                          env={"GPUPOOL_MEMORY": "4GiB"}) for i in range(2)]
    procs.append(start_client(server, hold_gpu, 8 * MIB, 60_000, seed=3,
                              env={"GPUPOOL_GPUS": "2"}))
    try:
        def leases() -> list[dict[str, Any]]:
            return server.get_json("/api/v1/leases?state=active")["leases"]

        wait_until("three leases", lambda: len(leases()) == 3, timeout=30)
        by_pid = {x["client"]["pid"]: x for x in leases()}
        share_ids = sorted(by_pid[p.pid]["id"] for p in procs[:2])
        multi = by_pid[procs[2].pid]
        assert multi["gpus"] == [1, 2], multi
        env = {**server.client_env(), "GPUPOOL_CONFIG": "none", "PYTHONPATH": str(REPO / "client")}
        status = run_client([sys.executable, "-m", "gpupool", "status"], env=env, timeout=60)
        assert status.returncode == 0, status.stderr
        out = status.stdout
        assert re.search(r"^  0 .* leased +2 of 2 shares \[me\] ", out, re.M), out
        assert "  GPU 0 shares: 2 of 2" in out
        for lease_id in share_ids:
            assert re.search(rf"^    lease {lease_id}: tests \(.*\) \[me\], \S+ MiB of 4\.0 GiB "
                             r"quota", out, re.M), out
        for gpu in (1, 2):
            assert re.search(rf"^  {gpu} .* leased +tests \(.*\) \[me\], lease {multi['id']} on "
                             r"GPUs 1, 2 ", out, re.M), out
        smi = run_client([sys.executable, "-m", "gpupool", "smi", "--json"], env=env,
                         timeout=60)
        assert smi.returncode == 0, smi.stderr
        view = json.loads(smi.stdout)
        assert sorted((p["lease"], p["gpu"]) for p in view["processes"]) == sorted(
            [(i, 0) for i in share_ids] + [(multi["id"], 1), (multi["id"], 2)])
        assert sorted(s["lease"] for s in view["shares"]) == share_ids
        assert {s["memory_quota"] for s in view["shares"]} == {4 * GIB}
        text = run_client([sys.executable, "-m", "gpupool", "smi"], env=env, timeout=60).stdout
        assert "leased (2/2 shares)" in text and "Shares of shared GPUs:" in text, text
    finally:
        for p in procs:
            p.kill()
            p.communicate(timeout=10)
