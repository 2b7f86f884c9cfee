#!/usr/bin/env python3
"""The /metrics benchmark: how long a Prometheus scrape takes while the pool is busy.

    python bench/metrics_bench.py [--quick] [--build DIR] [--markdown PATH] [--dashboards N]

gpupoold on 2 simulated GPUs over loopback (needs the native build, `build/` by default, and
nvcc's cuda.h for the test client tests/clients/hold_gpu.c): 8 clients stream 64 MiB
device-to-host copies, 2 holding the GPUs and 6 waiting in the queue (as bench/daemon_bench.py's
responsiveness part), and N web dashboards (default 2) stay open on /ui/events, so the daemon
builds and sends its live state on every change as it does for operators' browsers. Meanwhile
`GET /metrics` and `GET /healthz` are fetched in turn, one connection at a time (as Prometheus and
a monitoring probe do): a round every 50 ms for 20 s (the target case: far more often than
Prometheus scrapes, yet light), then back to back for 20 s (the stress case: the probes become
most of the daemon's work); p50/p99/max of each, the same probes on the idle daemon first.
Target: a scrape under 50 ms. Prints a table and a markdown section for
docs/benchmarks.md. The target is reported, not enforced.

The reference, in the same run and under the same load: bench/reference_http.py, an aiohttp
process that answers `GET /metrics` with a fixed body of the daemon's scrape size, fetched in
turn with the daemon's probes. On a machine whose cores the streaming clients and workers keep
busy, the slowest probes of both come from the scheduler (the daemon's process waiting for a
core), not from work done per scrape; the reference's max shows how much of that the machine
itself costs.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import daemon_bench as db  # noqa: E402 - bench/ is not a package

MIB = 1 << 20
TARGET_MS = 50.0
# A round of probes (daemon /metrics, daemon /healthz, reference /metrics) starts every PACE_S:
# many more scrapes than Prometheus makes (every 15 s by default), for percentiles, without the
# probes becoming the daemon's main work. The back-to-back phase after it is the stress case.
PACE_S = 0.05


def get(address: str, path: str) -> tuple[int, bytes]:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


class Reference:
    """bench/reference_http.py in its own process: a fixed /metrics body of `size` bytes."""

    def __init__(self, size: int) -> None:
        self.proc = subprocess.Popen([sys.executable, str(HERE / "reference_http.py"), str(size)],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().split()
        if len(line) != 2 or line[0] != "port":
            self.stop()
            raise RuntimeError(f"bench/reference_http.py did not start (said {line!r})")
        self.address = f"127.0.0.1:{line[1]}"

    def get(self, path: str) -> tuple[int, bytes]:
        return get(self.address, path)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.communicate()


class DashboardViewer(threading.Thread):
    """An open web dashboard: reads the server-sent events of /ui/events (the daemon runs with
    http_anonymous_read) and counts them, as a browser tab left open would."""

    def __init__(self, d: db.Daemon) -> None:
        super().__init__(daemon=True)
        host, port = d.http.rsplit(":", 1)
        self.conn = http.client.HTTPConnection(host, int(port), timeout=30)
        self.events = 0
        self.error = ""

    def run(self) -> None:
        try:
            self.conn.request("GET", "/ui/events")
            resp = self.conn.getresponse()
            if resp.status != 200:
                self.error = f"/ui/events answered {resp.status}"
                return
            while line := resp.readline():
                if line.startswith(b"event: state"):
                    self.events += 1
        except OSError as exc:  # closed by stop(), or the daemon went away
            self.error = self.error or str(exc)

    def stop(self) -> None:
        if self.conn.sock is not None:
            self.conn.sock.shutdown(2)
        self.conn.close()


def probe(d: db.Daemon, ref: Reference, seconds: float, pace: float = 0.0,
          ) -> tuple[list[float], list[float], list[float], int]:
    """(/metrics times, /healthz times, the reference's /metrics times, bytes of the last
    scrape), in turn for `seconds`: a round of the three every `pace` seconds, or back to back
    (pace 0)."""
    scrapes: list[float] = []
    health: list[float] = []
    reference: list[float] = []
    size = 0
    end = time.monotonic() + seconds
    next_round = time.monotonic()
    while time.monotonic() < end:
        next_round += pace
        time.sleep(max(0.0, next_round - time.monotonic()))
        for path, fetch, out in (("/metrics", d.get, scrapes), ("/healthz", d.get, health),
                                 ("/metrics", ref.get, reference)):
            t0 = time.perf_counter()
            status, body = fetch(path)
            out.append(time.perf_counter() - t0)
            if status != 200:
                raise RuntimeError(f"{path} answered {status}: {body[:300]!r}")
            if fetch == d.get and path == "/metrics":
                size = len(body)
    return scrapes, health, reference, size


def gauge(body: bytes, name: str) -> float:
    for line in body.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise RuntimeError(f"{name} not in the scrape")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a shorter run (5 s instead of 20 s)")
    ap.add_argument("--build", type=Path, default=Path(os.environ.get(
        "GPUPOOL_BUILD_DIR", db.ROOT / "build")), help="the native build directory")
    ap.add_argument("--markdown", type=Path, help="also write the markdown section here")
    ap.add_argument("--dashboards", type=int, default=2,
                    help="web dashboards left open during the run (default 2)")
    args = ap.parse_args()
    db.BUILD = args.build if args.build.is_absolute() else db.ROOT / args.build
    seconds = 5.0 if args.quick else 20.0
    client = db.build_client()
    d = db.Daemon(2, config="http_anonymous_read = true\n")
    procs: list[subprocess.Popen[str]] = []
    ref: Reference | None = None
    viewers = [DashboardViewer(d) for _ in range(args.dashboards)]
    try:
        for v in viewers:
            v.start()
        ref = Reference(len(d.get("/metrics")[1]))
        db.log("idle daemon: /metrics and /healthz (and the reference server's /metrics)")
        idle_m, idle_h, idle_r, _ = probe(d, ref, min(seconds, 3))
        for i in range(8):  # 2 stream copies, 6 wait in the queue
            procs.append(subprocess.Popen(
                [str(client), str(64 * MIB), str(int(2 * seconds * 1000) + 5000), str(i + 1),
                 "1000000"], env=d.client_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True))
        deadline = time.monotonic() + 30
        while True:
            body = d.get("/metrics")[1]
            if gauge(body, "gpupool_leases_active") == 2 and gauge(
                    body, "gpupool_queue_length") == 6:
                break
            if time.monotonic() > deadline:
                raise RuntimeError("the 8 clients did not reach 2 leases + 6 queued in 30 s")
            time.sleep(0.05)
        db.log(f"2 clients streaming, 6 queued: /metrics and /healthz every {PACE_S * 1000:g} ms "
               f"({seconds:g} s)")
        busy_m, busy_h, busy_r, size = probe(d, ref, seconds, PACE_S)
        db.log(f"2 clients streaming, 6 queued: /metrics and /healthz back to back ({seconds:g} s)")
        b2b_m, b2b_h, b2b_r, _ = probe(d, ref, seconds)
        body = d.get("/metrics")[1]
        active, queued = gauge(body, "gpupool_leases_active"), gauge(body, "gpupool_queue_length")
    finally:
        for p in procs:
            p.kill()
            p.communicate()
        if ref is not None:
            ref.stop()
        for v in viewers:
            v.stop()
        d.stop()
    ms = 1000.0

    def over(times: list[float]) -> str:
        return f"{sum(t * ms > TARGET_MS for t in times)} over {TARGET_MS:g} ms"

    every = f"every {PACE_S * 1000:g} ms"
    target = f"< {TARGET_MS:g} ms"
    rows = [
        (f"/metrics p50 ({every})", db.pct(busy_m, 50) * ms,
         f"idle p50 {db.pct(idle_m, 50) * ms:.2f} ms", ""),
        (f"/metrics p99 ({every})", db.pct(busy_m, 99) * ms,
         f"idle p99 {db.pct(idle_m, 99) * ms:.2f} ms", target),
        (f"/metrics max ({every})", max(busy_m) * ms,
         f"{len(busy_m)} scrapes, {size} bytes; {over(busy_m)}", target),
        (f"reference /metrics p99 ({every})", db.pct(busy_r, 99) * ms,
         f"idle p99 {db.pct(idle_r, 99) * ms:.2f} ms", ""),
        (f"reference /metrics max ({every})", max(busy_r) * ms,
         f"{len(busy_r)} fetches; {over(busy_r)}", ""),
        (f"/healthz p99 ({every})", db.pct(busy_h, 99) * ms,
         f"idle p99 {db.pct(idle_h, 99) * ms:.2f} ms", ""),
        (f"/healthz max ({every})", max(busy_h) * ms, f"{len(busy_h)} probes; {over(busy_h)}", ""),
        ("/metrics p99 (back to back)", db.pct(b2b_m, 99) * ms,
         f"reference p99 {db.pct(b2b_r, 99) * ms:.2f} ms", ""),
        ("/metrics max (back to back)", max(b2b_m) * ms,
         f"{len(b2b_m)} scrapes; {over(b2b_m)}", ""),
        ("reference /metrics max (back to back)", max(b2b_r) * ms,
         f"{len(b2b_r)} fetches; {over(b2b_r)}", ""),
        ("/healthz max (back to back)", max(b2b_h) * ms, f"{len(b2b_h)} probes; {over(b2b_h)}", ""),
    ]
    width = max(len(r[0]) for r in rows)
    for name, value, ref_text, target in rows:
        print(f"{name:<{width}}  {value:9.3f} ms  {ref_text:<32} {target}")
    print(f"(at the end: {active:g} leases active, {queued:g} queued; {len(viewers)} dashboards "
          f"open received {sum(v.events for v in viewers)} state events)")
    for v in viewers:
        if v.error and not v.events:
            print(f"warning: a dashboard stream failed: {v.error}", file=sys.stderr)
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=db.ROOT,
                             capture_output=True, text=True).stdout.strip()
    except OSError:
        rev = "?"
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    md = [f"### /metrics scrape time under load ({date}, commit {rev})", "",
          f"Machine: {platform.node()}, {os.cpu_count()} CPUs, {platform.platform()}; 2 simulated "
          "GPUs over loopback, 8 clients streaming 64 MiB D2H copies (2 leased, 6 queued), "
          f"{len(viewers)} web dashboards open (/ui/events); "
          "`/metrics` and `/healthz` fetched in turn with the reference server's `/metrics` "
          "(bench/reference_http.py: aiohttp, a fixed body of the scrape's size), one connection "
          f"each, a round every {PACE_S * 1000:g} ms for {seconds:g} s, then back to back for "
          f"{seconds:g} s. Command: "
          f"`python bench/metrics_bench.py{' --quick' if args.quick else ''}`.", "",
          "| metric | measured | reference (same run) | target |", "|---|---|---|---|"]
    for name, value, ref_text, target in rows:
        md.append(f"| {name} | {value:.3f} ms | {ref_text} | {target} |")
    db.benchlib.emit_markdown(md, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
