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
  gpupool   gpupoold (one simulated GPU) serving in the server namespace, and
            tests/c/copy_check through the shim in the client namespace: the best of --reps
            256 MiB sync copies each way (smaller at slow rates: about a second a copy) of zeros,
            of "half" data (4 KiB random, 4 KiB zeros: LZ4 halves it) and of random bytes, with
            GPUPOOL_COMPRESSION=off and =lz4;
  TLS       with --tls, a second gpupoold with a throw-away certificate beside the first, and the
            same copies without compression over TLS (GPUPOOL_TLS=1): TLS against plain where
            the link, not the CPU, sets the rate.

Prints each copy rate with its share of the shaped rate (the target: 90 % of it without
compression) and of the raw TCP figure, and, per data, the rates at which LZ4 beats no
compression by more than 5 % (less is noise): measured, not computed. tests/test_link_bench.py
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


def copies(link: Link, d: Daemon, copy_check: Path, mib: int, reps: int,
           compression: str, tls: benchlib.TlsFiles | None = None) -> dict[tuple[str, str], float]:
    env = d.client_env()
    if tls is not None:
        env.update(tls.client_env())
    env["GPUPOOL_SERVER"] = d.listen
    env["GPUPOOL_COMPRESSION"] = compression
    env["GPUPOOL_LOG"] = "quiet"
    proc = subprocess.run(["ip", "netns", "exec", link.client, str(copy_check), "bench",
                           str(mib), str(reps)], env=env, capture_output=True, text=True,
                          timeout=1800)
    got: dict[tuple[str, str], float] = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT "):])
            got[(r["pattern"], r["dir"])] = float(r["bytes_per_s"])
    if proc.returncode != 0 or len(got) != 2 * len(PATTERNS):
        raise RuntimeError(f"copy_check failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n"
                           f"{proc.stderr[-2000:]}")
    return got


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
    tls = benchlib.TlsFiles(SERVER_IP) if args.tls else None
    rows: list[dict[str, Any]] = []
    raws: list[tuple[str, dict[str, float]]] = []
    try:
        d = Daemon(1, name="link", netns=link.server, host=SERVER_IP)
        if tls is not None:
            tls_d = Daemon(1, name="link-tls", netns=link.server, host=SERVER_IP, port=7080,
                           config=tls.server_config())
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
                if comp == "off+TLS":
                    assert tls_d is not None
                    got = copies(link, tls_d, copy_check, mib, args.reps, "off", tls)
                else:
                    got = copies(link, d, copy_check, mib, args.reps, comp)
                for (pattern, direction), bps in sorted(got.items()):
                    rows.append({"rate": rate, "label": label, "compression": comp,
                                 "pattern": pattern, "dir": direction, "bps": bps,
                                 "raw": raw["up" if direction == "htod" else "down"],
                                 "mib": mib})
    finally:
        for daemon in (d, tls_d):
            if daemon is not None:
                daemon.close()
        if tls is not None:
            tls.remove()
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
    if tls is not None:
        for rate in rates:
            for direction in ("htod", "dtoh"):
                pairs = [(r["bps"], next(o["bps"] for o in rows if o["rate"] == rate and o[
                    "pattern"] == r["pattern"] and o["dir"] == direction and o["compression"] == "off"))
                    for r in rows if r["rate"] == rate and r["dir"] == direction
                    and r["compression"] == "off+TLS"]
                worst = min(t / o for t, o in pairs)
                label = "unshaped" if rate is None else f"{rate:g} Gbit/s"
                pays.append(f"TLS / plain, {label}, {'H2D' if direction == 'htod' else 'D2H'}: "
                            f"{worst:.2f}x at worst over the three data (target >= 0.8x)")
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
        args.json.write_text(json.dumps({"rows": rows, "lz4_pays": pays,
                                         "raw": {label: raw for label, raw in raws}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
