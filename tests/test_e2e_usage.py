"""End to end: GPU time accounting (issue 33, items 1 and 2). Two leases with known busy and idle
patterns (tests/clients/busy_idle.py: gp_test_spin kernels that spin for real time on the
simulated device) on a real gpupoold with two simulated GPUs give leased seconds equal to their
records' duration and busy seconds equal to the work they did, each within one sampling period
(`telemetry_interval`, 1 s); the daemon is restarted before anything is read, so the figures
come from what the stopping daemon wrote; `gpupoold report` agrees with the lease records.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, GpupoolServer, require, wait_until

from gpupoold.pool.usage_recorder import FLUSH_S

CLIENT = REPO / "tests" / "clients" / "busy_idle.py"
PERIOD_S = 1.0  # telemetry_interval's default: the sampling period


def have_cuda_python() -> bool:
    try:
        import cuda.bindings.driver  # noqa: F401
    except ImportError:
        return False
    return True


def ended(server: GpupoolServer) -> list[dict[str, Any]]:
    return server.get_json("/api/v1/leases?state=ended&limit=100")["leases"]


def test_leased_and_busy_seconds_of_two_leases_survive_a_restart(
        start_daemon: Any, native_build: Path) -> None:
    require(have_cuda_python(),
            "cuda-bindings is not installed (it comes with PyTorch: scripts/bootstrap.sh)")
    server = start_daemon("--simulated", "2", build_dir=native_build, simulated=None)
    wait_until("both GPUs free", lambda: [g["state"] for g in
                                          server.get_json("/api/v1/gpus")["gpus"]]
               == ["free", "free"])
    began = time.time()
    # A: busy 3 s, then idle 2 s. B: idle 1.5 s, busy 2 s, idle 1 s.
    patterns = {"3000,2000": 3.0, "0,1500,2000,1000": 2.0}
    procs = {p: subprocess.Popen([sys.executable, str(CLIENT), p], env=server.client_env(),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for p in patterns}
    for pattern, proc in procs.items():
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, f"{pattern}: exit {proc.returncode}\n{out}\n{err}"
        assert f"busy_s={patterns[pattern]:.3f}" in out, out
    wait_until("both leases ended", lambda: len(ended(server)) == 2, timeout=20)

    assert server.stop() == 0, server.log_text()[-3000:]  # nothing was read before the stop
    again = start_daemon("--simulated", "2", build_dir=server.build_dir, simulated=None,
                         state_dir=server.state_dir)
    records = sorted(ended(again), key=lambda r: r["busy_s"])
    assert len(records) == 2
    for rec, busy in zip(records, sorted(patterns.values()), strict=True):
        held = rec["ended"] - rec["started"]
        assert abs(rec["leased_s"] - held) <= PERIOD_S, rec
        assert abs(rec["busy_s"] - busy) <= PERIOD_S, rec

    period = ["--from", f"{began - 120:.0f}", "--to", f"{time.time() + 1:.0f}"]

    def report_cli(*how: str) -> str:
        proc = subprocess.run([sys.executable, "-m", "gpupoold", "report", "--http",
                               again.http_url, "--token", again.admin_token, *period, *how],
                              capture_output=True, text=True, timeout=30, cwd=REPO)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    report = json.loads(report_cli("--by", "token", "--json"))
    assert report["gpus"] == 2 and report["leases"] == 2
    leased = sum(r["leased_s"] for r in records)
    busy = sum(r["busy_s"] for r in records)
    assert report["leased_gpu_hours"] * 3600 == pytest.approx(leased, abs=0.01)
    assert report["busy_gpu_hours"] * 3600 == pytest.approx(busy, abs=0.01)
    [group] = report["groups"]
    assert group["token"] == records[0]["token_name"]
    assert report["summary"].startswith("the 2 GPUs were leased ")
    csv_lines = report_cli("--by", "gpu", "--csv").splitlines()
    assert csv_lines[0].startswith("gpu,gpu_hours,") and len(csv_lines) == 3  # a line a GPU
    assert sum(float(line.split(",")[1]) for line in csv_lines[1:]) * 3600 == pytest.approx(
        leased, abs=0.01)
    assert report["summary"] in report_cli("--by", "server")


def test_the_fleets_report_from_one_server_sums_both_servers(
        start_daemon: Any, native_build: Path, pg_url: str) -> None:
    """Two real gpupoold servers of one simulated GPU each on one PostgreSQL store (a fleet,
    tests/test_fleet.py), one lease of a known busy pattern on each: `gpupoold report --by server
    --json` asked of ONE server shows both servers, each with the leased seconds of its lease's
    record and the busy seconds its client did within one sampling period, and totals that are
    their sum (issue 33, acceptance: "the fleet's report sums the servers")."""
    from test_fleet import fleet, name_of

    require(have_cuda_python(),
            "cuda-bindings is not installed (it comes with PyTorch: scripts/bootstrap.sh)")
    a, b = fleet(start_daemon, native_build, pg_url, n=2)
    began = time.time()
    patterns = {name_of(a): (a, "2000,1000", 2.0), name_of(b): (b, "0,1000,1000", 1.0)}
    procs = {name: subprocess.Popen([sys.executable, str(CLIENT), pattern],
                                    env=server.client_env(), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
             for name, (server, pattern, _) in patterns.items()}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{out}\n{err}"
        assert f"busy_s={patterns[name][2]:.3f}" in out, out
    # Each server writes a lease's GPU time as the lease ends (right after its end record),
    # well within its periodic write (FLUSH_S, 10 s): the timeout is below that on purpose.
    wait_until("both leases ended and their GPU time written", lambda: (
        recs := ended(a), len(recs) == 2 and all(
            r["leased_s"] >= r["ended"] - r["started"] - PERIOD_S for r in recs))[-1],
        timeout=FLUSH_S / 2)
    records = {r["server"]: r for r in ended(a)}
    assert set(records) == set(patterns), records  # each client on its own server's GPU

    proc = subprocess.run([sys.executable, "-m", "gpupoold", "report", "--http", a.http_url,
                           "--token", a.admin_token, "--from", f"{began - 60:.0f}",
                           "--to", f"{time.time() + 1:.0f}", "--by", "server", "--json"],
                          capture_output=True, text=True, timeout=30, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    groups = {g["server"]: g for g in report["groups"]}
    assert set(groups) == set(patterns) and report["gpus"] == 2, report
    for name, (_, _, busy) in patterns.items():
        rec, group = records[name], groups[name]
        assert abs(group["gpu_hours"] * 3600 - (rec["ended"] - rec["started"])) <= PERIOD_S, \
            (name, group, rec)
        assert abs(group["busy_gpu_hours"] * 3600 - busy) <= PERIOD_S, (name, group, rec)
    for key, total in (("gpu_hours", "leased_gpu_hours"), ("busy_gpu_hours", "busy_gpu_hours")):
        assert report[total] == pytest.approx(sum(g[key] for g in groups.values()), abs=1e-9)
    assert report["leases"] == 2
