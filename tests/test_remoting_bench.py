"""bench/remoting_bench.py, short (--quick --reps 1 --tls): the harness must keep measuring every
figure it prints, the CPU seconds per GiB of the big copies on both sides, and plain against TLS.
The figures themselves are the benchmark's to report (docs/benchmarks.md), never asserted here;
the verdict arithmetic is checked on made-up numbers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import remoting_bench as rb  # noqa: E402 - bench/ is not a package

BIG = [f"{d}_{k}_{256 << 20}" for d in ("h2d", "d2h") for k in ("pinned", "pageable")]


def test_quick_run_measures_cpu_and_tls(native_build: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "remoting_bench.py"), "--no-build",
                           "--quick", "--reps", "1", "--launches", "20000", "--tls",
                           "--json", str(out)], capture_output=True, text=True, timeout=900,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    tcp = data["meta"]["tcp"]
    assert tcp["bulk_send_cpu_s_per_gib"] > 0 and tcp["bulk_recv_cpu_s_per_gib"] > 0
    for results in (data["results"], data["meta"]["tls_results"]):
        for name in BIG:
            r = results[name]
            assert r["value"] > 0 and r["cpu_s"] > 0 and r["bytes"] >= 256 << 20, r
            assert r["worker_cpu_s"] > 0, r  # read from the worker's scheduler counters
    assert "TLS / plain" in proc.stdout and "CPU time of the 256 MiB copies" in proc.stdout


def test_tls_rows_verdicts() -> None:
    def r(value: float, p50: float | None = None) -> dict:
        return {"value": value, **({"p50": p50} if p50 is not None else {})}

    plain = {"sync_rtt": r(20, 20), **{name: r(5e9) for name in BIG}}
    tls = {"sync_rtt": r(30, 27), BIG[0]: r(4.1e9), BIG[1]: r(3.9e9), BIG[2]: r(4e9), BIG[3]: r(1e9)}
    rows = {row[0]: row for row in rb.tls_rows(plain, tls)}
    rtt = rows["sync round trip (median), cudaStreamSynchronize"]
    assert rtt[3] == "1.35x" and rtt[5] == "MISS"  # medians: 27 / 20
    assert [rows[rb.copy_label(n)][5] for n in BIG] == ["PASS", "MISS", "PASS", "MISS"]


def test_cpu_table_per_gib() -> None:
    gib = 1 << 30
    res = {BIG[0]: {"cpu_s": 0.5, "worker_cpu_s": 0.25, "bytes": 2 * gib}}
    tcp = {"bulk_send_cpu_s_per_gib": 0.2, "bulk_recv_cpu_s_per_gib": 0.1}
    table = rb.cpu_table(tcp, res, md=True).splitlines()
    assert len(table) == 3  # head, rule, the one copy measured
    assert table[2] == "| H2D 256 MiB pinned | 0.250 | 0.125 | 0.375 | 0.300 | 1.25x |"
