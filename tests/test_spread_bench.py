"""bench/spread_bench.py, short (issue 37, acceptance point 2): three hosts on a bridge (servers A
and B with 2 simulated GPUs each on one PostgreSQL, and the client), a client of
GPUPOOL_GPUS=4 with GPUPOOL_SPREAD=1 that names and pins A only. Its 4 devices, their pointer
ranges, and peer copies across servers (0 to 2, 2 to 0; server to server, then through the
client) and within A (0 to 1), each bit-exact, beside raw TCP between every pair of hosts. The
harness must keep working (every figure measured, nothing left behind); the speeds are the
benchmark's to report (docs/benchmarks.md), never asserted here."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.parse
from pathlib import Path
from typing import Any

from conftest import REPO, require


def made_by_bench() -> set[str]:
    """The benchmark's namespaces (gps-*) and bridges (gpsbr*): other test files running at the
    same time (pytest-xdist) make and remove namespaces and links of their own."""
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return ({line.split()[0] for line in ns.splitlines() if line.startswith("gps-")}
            | {line.split(":")[1].strip() for line in links.splitlines()
               if line.split(":")[1].strip().startswith("gpsbr")})


def test_peer_copies_across_two_servers_are_exact_and_measured(
        native_build: Path, pg_server: Any, pg_url: str, tmp_path: Path) -> None:
    require(os.geteuid() == 0, "root is needed for network namespaces and tc")
    require(shutil.which("ip") is not None and shutil.which("tc") is not None,
            "ip and tc (iproute2) are needed")
    before = made_by_bench()
    # The session's PostgreSQL through its Unix socket: every namespace reaches it.
    name = urllib.parse.urlsplit(pg_url).path.lstrip("/")
    database = f"postgresql://gpupool@/{name}?host={pg_server.dir}&port={pg_server.port}"
    out = tmp_path / "spread.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "spread_bench.py"), "--rates", "",
                           "--mib", "4", "--reps", "1", "--database", database, "--json",
                           str(out)], capture_output=True, text=True, timeout=600, cwd=REPO)
    said = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, said
    data = json.loads(out.read_text())
    assert data["problems"] == [], said
    (run,) = data["runs"]
    assert run["label"] == "unshaped"
    # Raw TCP on every directed link of the three hosts.
    assert set(run["raw"]) == {"a>b", "b>a", "client>a", "a>client", "client>b", "b>client"}
    assert all(v is not None and v > 0 for v in run["raw"].values()), run["raw"]
    # The same copies both ways: server to server (GPUPOOL_SPREAD_COPY=server), through the
    # client (=client).
    for key in ("spread_server", "spread"):
        spread = run[key]
        assert spread is not None, (key, run[f"{key}_error"])
        assert spread["devices"] == 4
        assert spread["ranges_distinct"] and spread["pointer_ordinals"]
        # Peer access: none between servers, what the simulated driver answers within one.
        assert spread["can_access_peer"] == {"2:0": 0, "0:2": 0, "1:0": 1}, spread
        copies = [(c["src"], c["dst"]) for c in spread["copies"]]
        assert copies == [(0, 2), (2, 0), (0, 1)]
        for c in spread["copies"]:
            assert c["exact"] and c["bytes"] == 4 << 20 and c["bps"] > 0, c
    lines = proc.stdout.splitlines()
    for copy in ("peer 0->2 (A->B)", "peer 2->0 (B->A)"):
        for path in ("server to server", "through the client"):
            assert any(copy in line and path in line for line in lines), (copy, path, said)
    assert made_by_bench() == before  # the namespaces, their veths and the bridge are gone
