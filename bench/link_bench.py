#!/usr/bin/env python3
"""Copies over a shaped link: gpupool at real link rates without a real network.

    sudo python bench/link_bench.py [--rates 1,2.5,5,10,25] [--reps 2] [--max-mib 256]
                                    [--tls] [--markdown PATH] [--json PATH]

Root only (network namespaces and tc). The benchmark makes, and removes when it ends, two network
namespaces joined by a veth pair (10.77.0.1 for the server, 10.77.0.2 for the client: addresses
that exist only inside them), and shapes both directions with a `tbf` qdisc at each rate of
--rates (Gbit/s), after a run on the unshaped pair. At each rate, in the same run:

  raw TCP   bench/tcp_baseline.c, client in one namespace and server in the other: a 1 GiB
            stream one way (the upload figure) and 256 MiB answers the other (the download);
            and the same upload over two connections at once (what striping could gain);
  gpupool   gpupoold (one simulated GPU, plain TCP: `tls = "off"`, its clients GPUPOOL_TLS=0)
            serving in the server namespace, and
            tests/c/copy_check through the shim in the client namespace: the best of --reps
            256 MiB sync copies each way (smaller at slow rates: about a second a copy) of zeros,
            of "half" data (4 KiB random, 4 KiB zeros: LZ4 halves it) and of random bytes, with
            GPUPOOL_COMPRESSION=off and =lz4;
  TLS       with --tls, a second gpupoold beside the first with gpupoold's default, TLS with the
            server's own identity, its clients pinned to it; the same copies without compression
            and round trips (copy_check rtt: synchronous 4-byte copies, median) over each:
            TLS against plain where the link, not the CPU, sets the rate. CPU seconds per GiB
            moved, for plain and TLS: the client's (copy_check's own clock, shim threads
            included, per direction) and the server's (the workers' and scrubs' CPU, read from
            gpupoold's reaped children around each run of copies, both directions together).
            Whether the kernel offers kTLS (TCP_ULP "tls") is said, and that gpupool's TLS runs
            in user space either way.

Prints each copy rate with its share of the shaped rate (the target: 90 % of it without
compression) and of the raw TCP figure, and, per data, the rates at which LZ4 beats no
compression by more than 5 % (less is noise): measured, not computed; with --tls, TLS against
plain (targets: copies >= 0.90x at 10 and 25 Gbit/s, round trips <= 1.3x). tests/test_link_bench.py
runs a short version (one rate, small copies) to keep the harness working; its figures are not
asserted. Exit status 1 when a figure could not be measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402
from benchlib import BUILD, ROOT, Daemon  # noqa: E402

MIB = 1 << 20
SERVER_IP, CLIENT_IP = "10.77.0.1", "10.77.0.2"
PATTERNS = ("zeros", "half", "random")


def log(msg: str) -> None:
    print(f"[link] {msg}", file=sys.stderr, flush=True)


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=check)


class Link:
    """Two namespaces and a veth pair between them; `shape(gbit)` sets both directions."""

    def __init__(self) -> None:
        tag = os.getpid() % 100000
        self.server, self.client = f"gpl-srv-{tag}", f"gpl-cli-{tag}"
        self.veth_s, self.veth_c = f"gpls{tag}", f"gplc{tag}"
        sh("ip", "netns", "add", self.server)
        sh("ip", "netns", "add", self.client)
        sh("ip", "link", "add", self.veth_s, "type", "veth", "peer", "name", self.veth_c)
        for ns, dev, ip in ((self.server, self.veth_s, SERVER_IP),
                            (self.client, self.veth_c, CLIENT_IP)):
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{ip}/30", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        self.shaped: float | None = None

    def shape(self, gbit: float | None) -> None:
        for ns, dev in ((self.server, self.veth_s), (self.client, self.veth_c)):
            sh("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
            if gbit is not None:
                rate_bytes = gbit * 1e9 / 8
                # A burst of at least a few milliseconds of traffic (and of a 64 KiB GSO packet):
                # tbf refuses packets larger than its bucket, and a small bucket under-shoots.
                burst = max(int(rate_bytes * 0.004), 4 * MIB)
                sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                   f"{gbit}gbit", "burst", str(burst), "latency", "100ms")
        self.shaped = gbit

    def close(self) -> None:
        for ns in (self.server, self.client):
            sh("ip", "netns", "del", ns, check=False)  # the veth pair goes with them


def build() -> tuple[Path, Path]:
    out = BUILD / "bench"
    out.mkdir(parents=True, exist_ok=True)
    tcp = out / "tcp_baseline"
    src = ROOT / "bench" / "tcp_baseline.c"
    if not tcp.exists() or tcp.stat().st_mtime < src.stat().st_mtime:
        subprocess.run([os.environ.get("CC", "cc"), "-std=c11", "-O2", "-Wall", "-Wextra", "-o",
                        str(tcp), str(src)], check=True)
    copy_check = BUILD / "tests" / "copy_check"
    if not copy_check.exists():  # `make` builds it with the tests' programs
        sys.exit(f"link_bench: {copy_check} is missing: run `make` first")
    return tcp, copy_check


def raw_tcp(link: Link, tcp: Path) -> dict[str, float]:
    out = sh("ip", "netns", "exec", link.client, str(tcp), "--server-netns", link.server,
             "--host", SERVER_IP, "--quick", "--reps", "1", "--streams", "2").stdout
    r = json.loads(out)
    return {"up": float(r["bulk_Bps"]), "down": float(r["reqresp_Bps"][str(256 * MIB)]),
            "up2": float(r["bulk_parallel_Bps"])}


def reaped_cpu(d: Daemon) -> float:
    """CPU seconds of gpupoold's reaped children (its workers and scrubs, once they exited)."""
    assert d.proc is not None
    fields = Path(f"/proc/{d.proc.pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")  # cutime, cstime


def client_run(link: Link, d: Daemon, copy_check: Path, args: list[str],
               compression: str = "off") -> list[dict[str, Any]]:
    """copy_check ARGS in the client namespace against `d`; its RESULT records."""
    env = d.client_env()
    env["GPUPOOL_SERVER"] = d.listen
    env["GPUPOOL_COMPRESSION"] = compression
    env["GPUPOOL_LOG"] = "quiet"
    proc = subprocess.run(["ip", "netns", "exec", link.client, str(copy_check), *args], env=env,
                          capture_output=True, text=True, timeout=1800)
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines()
               if line.startswith("RESULT ")]
    if proc.returncode != 0 or not results:
        raise RuntimeError(f"copy_check {' '.join(args)} failed ({proc.returncode}):\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return results


def copies(link: Link, d: Daemon, copy_check: Path, mib: int, reps: int,
           compression: str) -> tuple[dict[tuple[str, str], dict[str, float]], float]:
    """{(pattern, dir): {"bps", "cpu_s", "bytes"}} of the client, and the server's CPU seconds
    for the whole run (its worker ends with copy_check; its CPU counts once it is reaped)."""
    assert d.proc is not None
    children = Path(f"/proc/{d.proc.pid}/task/{d.proc.pid}/children")
    waiting = set(children.read_text().split())  # the pre-started worker serves the lease
    before = reaped_cpu(d)
    results = client_run(link, d, copy_check, ["bench", str(mib), str(reps)], compression)
    got = {(r["pattern"], r["dir"]): {"bps": float(r["bytes_per_s"]), "cpu_s": float(r["cpu_s"]),
                                      "bytes": float(r["bytes"])} for r in results}
    if len(got) != 2 * len(PATTERNS):
        raise RuntimeError(f"copy_check bench gave {len(got)} results, not {2 * len(PATTERNS)}")
    # The worker's CPU counts once it has exited and been reaped (its API is in the server's
    # namespace); then the scrub after it, a moment.
    deadline = time.monotonic() + 30
    while waiting & set(children.read_text().split()) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    return got, reaped_cpu(d) - before


def round_trip(link: Link, d: Daemon, copy_check: Path) -> float:
    """The median round trip (µs) of synchronous 4-byte copies to the host."""
    return float(client_run(link, d, copy_check, ["rtt", "2000"])[0]["rtt_us"])


def gbit(bps: float) -> str:
    return f"{bps * 8 / 1e9:.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="1,2.5,5,10,25", help="shaped rates in Gbit/s")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-mib", type=int, default=256, help="largest copy, in MiB")
    ap.add_argument("--markdown", type=Path)
    ap.add_argument("--json", type=Path, help="every figure, for tests")
    ap.add_argument("--tls", action="store_true",
                    help="also copy over TLS (a second gpupoold with tls_cert), compression off")
    args = ap.parse_args()
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        sys.exit("link_bench: needs root, ip and tc (network namespaces, veth and tbf)")
    rates: list[float | None] = [None, *(float(r) for r in args.rates.split(","))]
    tcp, copy_check = build()
    link = Link()
    d: Daemon | None = None
    tls_d: Daemon | None = None
    rows: list[dict[str, Any]] = []
    raws: list[tuple[str, dict[str, float]]] = []
    server_cpu: dict[tuple[str, str], float] = {}  # (label, wire) -> server CPU s/GiB
    rtts: dict[tuple[str, str], float] = {}  # (label, wire) -> median µs
    try:
        # The plain figures are plain TCP, said on both ends (TLS is gpupoold's default):
        # `tls = "off"`, and its clients get GPUPOOL_TLS=0 (Daemon.client_env).
        d = Daemon(1, name="link", netns=link.server, host=SERVER_IP, config='tls = "off"\n')
        if args.tls:  # gpupoold's default: TLS with its own identity, pinned by its clients
            tls_d = Daemon(1, name="link-tls", netns=link.server, host=SERVER_IP, port=7080)
            assert tls_d.fingerprint is not None, "the TLS daemon printed no identity"
        for rate in rates:
            link.shape(rate)
            label = "unshaped" if rate is None else f"{rate:g} Gbit/s"
            raw = raw_tcp(link, tcp)
            raws.append((label, raw))
            budget = raw["up"] if rate is None else rate * 1e9 / 8
            mib = int(min(args.max_mib, max(min(32, args.max_mib), budget / MIB)))  # ~1 s a copy
            log(f"{label}: raw TCP up {gbit(raw['up'])} / down {gbit(raw['down'])} Gbit/s; "
                f"copies of {mib} MiB")
            for comp in ("off", "lz4", *(["off+TLS"] if tls_d else [])):
                daemon = tls_d if comp == "off+TLS" else d
                assert daemon is not None
                got, server_s = copies(link, daemon, copy_check, mib, args.reps,
                                       "lz4" if comp == "lz4" else "off")
                if comp != "lz4":
                    moved = sum(g["bytes"] for g in got.values())
                    server_cpu[(label, comp)] = server_s / (moved / (1 << 30))
                    rtts[(label, comp)] = round_trip(link, daemon, copy_check)
                for (pattern, direction), g in sorted(got.items()):
                    rows.append({"rate": rate, "label": label, "compression": comp,
                                 "pattern": pattern, "dir": direction, "bps": g["bps"],
                                 "cpu_s": g["cpu_s"], "bytes": g["bytes"],
                                 "raw": raw["up" if direction == "htod" else "down"],
                                 "mib": mib})
    finally:
        for daemon in (d, tls_d):
            if daemon is not None:
                daemon.close()
        link.close()
    head = ("link", "data", "direction", "wire", "copy Gbit/s", "of shaped rate", "of raw TCP")
    body = []
    for r in rows:
        shaped = "" if r["rate"] is None else f"{100 * r['bps'] * 8 / (r['rate'] * 1e9):.0f} %"
        body.append((r["label"], r["pattern"], "H2D" if r["dir"] == "htod" else "D2H",
                     r["compression"], gbit(r["bps"]), shaped, f"{100 * r['bps'] / r['raw']:.0f} %"))
    print(benchlib.text_table(head, body))
    pays = []
    for pattern in PATTERNS:
        for direction in ("htod", "dtoh"):
            wins = [r["label"] for r in rows if r["pattern"] == pattern and r["dir"] == direction
                    and r["compression"] == "lz4" and r["bps"] > 1.05 * next(
                        o["bps"] for o in rows if o["rate"] == r["rate"] and o["pattern"] == pattern
                        and o["dir"] == direction and o["compression"] == "off")]
            pays.append(f"{pattern} {'H2D' if direction == 'htod' else 'D2H'}: LZ4 more than 5 % "
                        f"faster at {', '.join(wins) if wins else 'no rate measured'}")
    if tls_d is not None:
        for rate in rates:
            label = "unshaped" if rate is None else f"{rate:g} Gbit/s"
            # The targets hold where the link sets the rate; unshaped, the CPU does.
            target = rate is not None and rate >= 10
            for direction in ("htod", "dtoh"):
                pairs = [(r["bps"], next(o["bps"] for o in rows if o["rate"] == rate and o[
                    "pattern"] == r["pattern"] and o["dir"] == direction and o["compression"] == "off"))
                    for r in rows if r["rate"] == rate and r["dir"] == direction
                    and r["compression"] == "off+TLS"]
                worst = min(t / o for t, o in pairs)
                verdict = (f" (target >= 0.90x: {'met' if worst >= 0.9 else 'MISSED'})"
                           if target else "")
                pays.append(f"TLS / plain copies, {label}, "
                            f"{'H2D' if direction == 'htod' else 'D2H'}: {worst:.2f}x at worst "
                            f"over the three data{verdict}")
                cpu = {wire: sum(r["cpu_s"] for r in rows if r["rate"] == rate
                                 and r["dir"] == direction and r["compression"] == wire)
                       / (sum(r["bytes"] for r in rows if r["rate"] == rate
                              and r["dir"] == direction and r["compression"] == wire) / (1 << 30))
                       for wire in ("off", "off+TLS")}
                pays.append(f"client CPU per GiB, {label}, "
                            f"{'H2D' if direction == 'htod' else 'D2H'}: plain "
                            f"{cpu['off']:.3f} s, TLS {cpu['off+TLS']:.3f} s")
            pays.append(f"server CPU per GiB (workers and scrubs, both directions), {label}: "
                        f"plain {server_cpu[(label, 'off')]:.3f} s, TLS "
                        f"{server_cpu[(label, 'off+TLS')]:.3f} s")
            plain_rtt, tls_rtt = rtts[(label, "off")], rtts[(label, "off+TLS")]
            pays.append(f"round trip (4-byte sync copy, median), {label}: plain {plain_rtt:.0f} us, "
                        f"TLS {tls_rtt:.0f} us, {tls_rtt / plain_rtt:.2f}x (target <= 1.3x: "
                        f"{'met' if tls_rtt <= 1.3 * plain_rtt else 'MISSED'})")
        pays.append(benchlib.ktls_status())
    for label, raw in raws:
        pays.append(f"raw TCP upload, {label}: one connection {gbit(raw['up'])} Gbit/s, two at "
                    f"once {gbit(raw['up2'])} Gbit/s ({raw['up2'] / raw['up']:.2f}x: what striping "
                    "could add at most)")
    print("\n".join(pays))
    lines = [f"### Shaped link ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
             f"{benchlib.cpu_model()}, {os.cpu_count()} CPUs, simulated GPU; veth + tbf between "
             "two network namespaces)", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head),
             *("| " + " | ".join(b) + " |" for b in body), "", *(f"- {p}" for p in pays)]
    benchlib.emit_markdown(lines, args.markdown)
    if args.json:
        args.json.write_text(json.dumps({
            "rows": rows, "lz4_pays": pays, "raw": {label: raw for label, raw in raws},
            "rtt_us": {f"{label} {wire}": v for (label, wire), v in rtts.items()},
            "server_cpu_s_per_gib": {f"{label} {wire}": v
                                     for (label, wire), v in server_cpu.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
