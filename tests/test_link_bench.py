"""bench/link_bench.py, short: two network namespaces, a veth pair shaped with tbf, gpupoold in
one and the shim's copies in the other, with and without LZ4, and over TLS. The harness must keep working
(every figure measured, nothing left behind); the figures themselves are the benchmark's to
report (docs/benchmarks.md), never asserted here."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import REPO, require


def netns_names() -> set[str]:
    """The benchmark's namespaces (bench/link_bench.py names them gpl-*): other test files
    running at the same time (pytest-xdist) make and remove namespaces of their own."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.startswith("gpl-")}


def test_the_shaped_link_benchmark_runs_and_cleans_up(native_build: Path, tmp_path: Path) -> None:
    require(os.geteuid() == 0, "root is needed for network namespaces and tc")
    require(shutil.which("ip") is not None and shutil.which("tc") is not None,
            "ip and tc (iproute2) are needed")
    before = netns_names()
    out = tmp_path / "link.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "link_bench.py"), "--rates", "10",
                           "--reps", "1", "--max-mib", "32", "--tls", "--json", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    combos = {(r["label"], r["pattern"], r["dir"], r["compression"]) for r in rows}
    # unshaped and 10 Gbit/s; three data; both directions; off, lz4 and TLS
    assert len(combos) == 2 * 3 * 2 * 3, sorted(combos)
    assert all(r["bps"] > 0 and r["raw"] > 0 for r in rows)
    assert netns_names() == before  # the namespaces (and the veth pair) are gone
    assert "Shaped link" in proc.stdout
    assert "TLS / plain copies, 10 Gbit/s, H2D" in proc.stdout
    assert "round trip (4-byte sync copy, median), 10 Gbit/s: plain" in proc.stdout
    assert "client CPU per GiB, 10 Gbit/s, D2H: plain" in proc.stdout
    assert "kTLS: " in proc.stdout  # offered or not, said either way
    assert all(r["cpu_s"] > 0 and r["bytes"] > 0 for r in rows)  # the client's own CPU clock
    data = json.loads(out.read_text())
    assert set(data["rtt_us"]) == {f"{label} {wire}" for label in ("unshaped", "10 Gbit/s")
                                   for wire in ("off", "off+TLS")}
    assert all(v > 0 for v in data["rtt_us"].values())
    assert all(v > 0 for v in data["server_cpu_s_per_gib"].values())  # the workers' CPU
    raw = data["raw"]
    assert set(raw) == {"unshaped", "10 Gbit/s"}
    assert all(r["up2"] > 0 for r in raw.values())  # two connections at once, for striping
