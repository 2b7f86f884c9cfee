"""bench/fleet_scale.py (issue 34, item 1), small: its checks first (a GPU given twice in the
shared lease history is found, a detached lease's GPU counts as given back, overtaking is counted
against arrival order, the servers' sync durations are summed up), then the benchmark itself
with 6 servers of one simulated GPU each on a real PostgreSQL and 150 light clients in bursts and
a stream, a tenth of them idle long enough to be detached: every client is served, exactly once,
and no GPU is ever given to two leases at once. Its timings are the benchmark's to report
(docs/benchmarks.md), never asserted here."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections import deque
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from conftest import REPO, require

from gpupoold.pool.fleet_view import sync_ms

BENCH = REPO / "bench" / "fleet_scale.py"


@pytest.fixture(scope="module")
def fs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fleet_scale", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fleet_scale"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_overlapping_leases_on_one_gpu_are_double_assignments(fs: ModuleType) -> None:
    # (id, server, gpu_index, started, ended)
    clean = [(1, "a", 0, 10.0, 12.0), (2, "a", 0, 12.5, 13.0), (3, "b", 0, 11.0, 14.0),
             (4, "a", 1, 11.0, None)]
    assert fs.double_assignments(clean) == []
    assert fs.turnarounds(clean) == [0.5]
    twice = [*clean, (5, "b", 0, 13.5, 15.0), (6, "a", 1, 20.0, 21.0)]
    found = fs.double_assignments(twice)
    assert len(found) == 2, found
    assert found[0].startswith("a GPU 1: lease 6 began at 20.000 before lease 4 ended (None)")
    assert found[1].startswith("b GPU 0: lease 5 began at 13.500 before lease 3 ended (14.0)")


def test_a_detached_lease_holds_its_gpu_only_while_attached(fs: ModuleType) -> None:
    # Lease 1 on a's GPU 0 from 10, detached at 11, back on GPU 1 at 13, ended at 14; lease 2
    # took GPU 0 at 11.5.
    leases = [(1, "a", 0, 10.0, 14.0, 101), (2, "a", 0, 11.5, 12.5, 102)]
    events = [(1, 13.0, "attached", 1), (1, 11.0, "detached", 0)]
    occupied = fs.occupancy(leases, events)
    assert sorted(occupied) == [(1, "a", 0, 10.0, 11.0), (1, "a", 1, 13.0, 14.0),
                                (2, "a", 0, 11.5, 12.5)]
    assert fs.double_assignments(occupied) == []
    # Without its detach, lease 1 would have shared GPU 0 with lease 2.
    assert len(fs.double_assignments(fs.occupancy(leases, []))) == 1
    # Back on GPU 0 while lease 2 still has it: given twice.
    back = [(1, 12.0, "attached", 0), (1, 11.0, "detached", 0)]
    assert len(fs.double_assignments(fs.occupancy(leases, back))) == 1


def test_overtaking_counts_later_arrivals_granted_sooner(fs: ModuleType) -> None:
    def c(n: int, arrived: float, granted: float) -> Any:
        return fs.Client(n, "", 0.0, 0.0, arrived=arrived, granted=granted)

    fifo = [c(0, 0.0, 1.0), c(1, 0.5, 2.0), c(2, 1.0, 3.0), c(3, 1.5, 0.0)]  # 3: not served
    assert fs.overtaking(fifo, 0.25) == 0
    # 0 arrived first and was granted last: 1, 2 and 3 overtook it; 3 also overtook 1.
    late = [c(0, 0.0, 9.0), c(1, 1.0, 5.0), c(2, 2.0, 6.0), c(3, 3.0, 4.0)]
    assert fs.overtaking(late, 0.25) == 3
    # Arrivals closer than the slack (one burst) do not count.
    assert fs.overtaking(late, 1.5) == 2  # 2 and 3 are 2 s and more after 0; nothing after 1
    assert fs.percentile([5.0, 1.0, 3.0, 2.0, 4.0], 50) == 3.0
    assert fs.percentile([float(n) for n in range(1, 101)], 99) == 99.0


def test_the_fleet_view_tells_the_syncs_durations() -> None:
    assert sync_ms(None) is None
    fleet: Any = SimpleNamespace(sync_seconds=deque([0.004, 0.002, 0.1, 0.003], maxlen=1000))
    assert sync_ms(fleet) == {"p50": 4.0, "p99": 100.0, "max": 100.0, "n": 4}


def test_a_small_fleet_serves_every_client_once_and_never_a_gpu_twice(
        native_build: Path, tmp_path: Path) -> None:
    import pg_server

    require(not (why := pg_server.available()), why)
    out = tmp_path / "scale.json"
    env = {**os.environ, "GPUPOOL_BUILD_DIR": str(native_build)}
    proc = subprocess.run([sys.executable, str(BENCH), "--loopback", "--servers", "6", "--gpus",
                           "1", "--clients", "150", "--hold-min", "0.05", "--hold-max", "0.2",
                           "--detach-after", "0.5", "--rest", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["served"] == 150 and got["refused"] == []
    assert got["leases"] == 150 and got["served_not_once"] == 0  # one lease per client
    assert got["double_assignments"] == 0, got["doubles"]
    assert got["redirected"] > 0  # clients went to other servers' GPUs: the fleet was one
    assert got["idle_clients"] == 15 and got["detaches"] > 0  # idle leases gave their GPU back
    assert isinstance(got["sync"], str) and got["sync"].startswith("p50 ")  # measured
    assert proc.stdout.strip().splitlines()[-1].startswith(
        "servers 6, clients served 150 of 150, double assignments 0, grant p99 ")
