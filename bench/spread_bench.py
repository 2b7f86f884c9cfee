#!/usr/bin/env python3
"""Peer copies of a lease spread over two servers, against raw TCP on the same links (issue 37).

    sudo .venv/bin/python bench/spread_bench.py [--rates 1] [--client-rates 1] [--mib 256]
                                                [--reps 3] [--database URL] [--markdown PATH]
                                                [--json PATH]

Root only (network namespaces and tc). Three hosts on a bridge that the benchmark makes and
removes when it ends, each in a network namespace of its own with its own address: server A
(10.203.0.11), server B (.12) and the client (.13); the bridge itself is .1 (the benchmark's
own view of the servers' HTTPS APIs). Unshaped first, then at each rate of --rates (Gbit/s; ""
for none) every host's veth is shaped with a `tbf` qdisc in both directions, as a NIC of that
rate would be: the link, not the CPU, then sets the figures. Then at each rate of --client-rates
(default none) only the client's veth is shaped: a client behind a slower link than the
servers' (which a copy from server to server does not cross at all).

A real PostgreSQL (tests/pg_server.py, or --database: a URL every namespace can reach, such as
its Unix socket) and on it gpupoold A and B with 2 simulated GPUs each, TLS with their own
identities (gpupoold's default); the client names and pins A only (B's pin comes in A's
redirect). A client of GPUPOOL_GPUS=4 with GPUPOOL_SPREAD=1 gets A's 2 GPUs (devices 0, 1) and
B's 2 (devices 2, 3): no server has 4. At each rate, in the same run:

  raw TCP   bench/tcp_baseline.c from A to B and from the client to each server: a 256 MiB
            bulk stream one way (A to B, the client to the server) and 256 MiB answers the
            other (B to A, the server to the client);
  gpupool   bench/spread_client.py in the client's namespace, twice: with
            GPUPOOL_SPREAD_COPY=server (copies across servers go from server to server) and
            =client (through the client): 4 devices, distinct pointer ranges, then the best of
            --reps cuMemcpyPeer of --mib MiB of random bytes from device 0 to 2 (A to B), 2 to
            0 (B to A) and 0 to 1 (within A: a peer copy on one server, the reference), each
            read back and compared, bit-exact, outside the timing.

Server to server, the source server's worker streams to the destination server's worker over a
link the two gpupoolds opened: its bound is raw TCP between A and B. Through the client
(device-to-host from the source's server, host-to-device to the destination's, in chunks) a
copy crosses the client's link twice, once in each direction, so its bound is the slower of the
two client legs (source server to client, client to destination server) when the legs overlap,
half of that when they do not. Prints a table, each copy's rate by both paths and their ratios
to both bounds, and what limits each figure. Exit status 1 when a
figure could not be measured or a copy was not bit-exact (then the gpupool part says "spread
copies: not measured: <the client's error>"). tests/test_spread_bench.py runs a short version.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import benchlib  # noqa: E402
from benchlib import BUILD, ROOT  # noqa: E402

MIB = 1 << 20
NET = "10.203.0"  # a subnet of its own (the tests' namespaces use 10.201 and 10.202)
HOSTS = {"a": 11, "b": 12, "client": 13}
NAMES = {"a": "A", "b": "B", "client": "client"}
REMOTING_PORT, HTTP_PORT = 7070, 7071
PAIRS = ((0, 2), (2, 0), (0, 1))
PATHS = {"spread_server": "server to server", "spread": "through the client"}  # run's keys
CLIENT = Path(__file__).resolve().parent / "spread_client.py"


def log(msg: str) -> None:
    print(f"[spread] {msg}", file=sys.stderr, flush=True)


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


class Lan:
    """A bridge ({net}.1) and one namespace per host with a veth on it; `shape(gbit)` puts a
    tbf on both ends of every host's veth (its upload and its download). Removed by close().
    net and prefix (of the namespaces, "-"; the bridge, "br"; the veths) let a test make its own
    beside the benchmark's (tests/test_spread_links_netns.py)."""

    def __init__(self, net: str = NET, prefix: str = "gps") -> None:
        tag = os.getpid() % 100000
        self.net = net
        self.bridge = f"{prefix}br{tag}"
        self.ns = {h: f"{prefix}-{h}-{tag}" for h in HOSTS}
        self.veth = {h: f"{prefix}{h[0]}{tag}" for h in HOSTS}  # its peer on the bridge: +"b"
        self._made: list[tuple[str, ...]] = []
        try:
            sh("ip", "link", "add", self.bridge, "type", "bridge")
            self._made.append(("ip", "link", "del", self.bridge))
            sh("ip", "addr", "add", f"{net}.1/24", "dev", self.bridge)
            sh("ip", "link", "set", self.bridge, "up")
            for h in HOSTS:
                ns, veth = self.ns[h], self.veth[h]
                sh("ip", "netns", "add", ns)
                self._made.append(("ip", "netns", "del", ns))
                sh("ip", "link", "add", veth, "type", "veth", "peer", "name", f"{veth}b")
                sh("ip", "link", "set", veth, "netns", ns)
                sh("ip", "link", "set", f"{veth}b", "master", self.bridge, "up")
                sh("ip", "-n", ns, "addr", "add", f"{self.ip(h)}/24", "dev", veth)
                sh("ip", "-n", ns, "link", "set", veth, "up")
                sh("ip", "-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def ip(self, host: str) -> str:
        return f"{self.net}.{HOSTS[host]}"

    def cut(self, h1: str, h2: str) -> None:
        """Hosts h1 and h2 can no longer reach each other (an unreachable route in each one's
        namespace: a connection fails at once), while both still reach the others."""
        for src, dst in ((h1, h2), (h2, h1)):
            sh("ip", "-n", self.ns[src], "route", "add", "unreachable", f"{self.ip(dst)}/32")

    def shape(self, gbit: float | None, hosts: tuple[str, ...] = tuple(HOSTS)) -> None:
        """Every host's veth at gbit (None: unshaped); the hosts not in `hosts` unshaped."""
        for h in HOSTS:
            rate = gbit if h in hosts else None
            for where in (["-n", self.ns[h], "dev", self.veth[h]], ["dev", f"{self.veth[h]}b"]):
                ns, dev = where[:-2], where[-2:]
                sh("tc", *ns, "qdisc", "del", *dev, "root", check=False)
                if rate is not None:
                    # A bucket of a few milliseconds of traffic and at least a 64 KiB GSO packet
                    # (tbf drops packets larger than its bucket), as bench/link_bench.py.
                    burst = max(int(rate * 1e9 / 8 * 0.004), 4 * MIB)
                    sh("tc", *ns, "qdisc", "add", *dev, "root", "tbf", "rate", f"{rate}gbit",
                       "burst", str(burst), "latency", "100ms")

    def close(self) -> None:
        for cmd in reversed(self._made):  # the veths go with their namespaces
            sh(*cmd, check=False)
        self._made.clear()


class Server:
    """gpupoold with 2 simulated GPUs in host `h`'s namespace, on the fleet's database, TLS with
    its own identity; its HTTPS API is reached from here through the bridge."""

    def __init__(self, lan: Lan, h: str, database: str) -> None:
        self.name = h
        self.ip = lan.ip(h)
        self.state = Path(tempfile.mkdtemp(prefix=f"gpupool-spread-{h}-"))
        self.log_path = self.state / "gpupoold.log"
        self.address = f"{self.ip}:{REMOTING_PORT}"
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT), str(ROOT / "protocol" / "python"), *filter(None, [self.env.get("PYTHONPATH")])])
        cmd = ["ip", "netns", "exec", lan.ns[h], sys.executable, "-m", "gpupoold", "serve",
               "--simulated", "2", "--listen", self.address, "--http", f"{self.ip}:{HTTP_PORT}",
               "--database", database, "--state-dir", str(self.state),
               "--worker", str(BUILD / "gpupool-worker"), "--sim-lib",
               str(BUILD / "libgpupool-sim.so")]
        with self.log_path.open("wb") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        self.fingerprint = ""
        self.ssl: ssl.SSLContext | None = None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_started(self) -> None:
        """Up, its identity printed and its HTTP listener speaking HTTPS with that identity."""
        deadline = time.monotonic() + 60
        while "the HTTP listener speaks HTTPS" not in self.log_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gpupoold {self.name} did not start:\n{self.log_text()}")
            time.sleep(0.05)
        identity = benchlib.identity_line(self.log_text())
        if not isinstance(identity, str):
            raise RuntimeError(f"gpupoold {self.name} printed no TLS identity:\n{self.log_text()}")
        self.fingerprint = identity
        # The HTTPS certificate is the server's own identity: trusted as its own CA.
        self.ssl = ssl.create_default_context(cafile=str(self.state / "identity" / "server.crt"))
        self.ssl.check_hostname = False
        self.admin = (self.state / "local-admin.token").read_text().strip()

    def get(self, path: str) -> Any:
        req = urllib.request.Request(f"https://{self.ip}:{HTTP_PORT}{path}",
                                     headers={"Authorization": f"Bearer {self.admin}"})
        with urllib.request.urlopen(req, timeout=30, context=self.ssl) as reply:
            return json.loads(reply.read())

    def quiet(self) -> bool:
        """Both GPUs free with their pre-started workers."""
        gpus = self.get("/api/v1/gpus")["gpus"]
        return len(gpus) == 2 and all(g["state"] == "free" and g["worker_ready"] for g in gpus)

    def close(self) -> None:
        benchlib.stop_process_group(self.proc, 30)
        benchlib.remove_state(self.state)


def wait(what: str, check: Any, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not after {timeout:.0f} s")
        time.sleep(0.2)


def socket_url(pg: Any) -> str:
    """A new database of `pg` through its Unix socket: reachable from every namespace (its
    loopback address is not)."""
    name = urllib.parse.urlsplit(pg.new_database()).path.lstrip("/")
    return f"postgresql://gpupool@/{name}?host={pg.dir}&port={pg.port}"


def build_tcp() -> Path:
    out = BUILD / "bench"
    out.mkdir(parents=True, exist_ok=True)
    tcp = out / "tcp_baseline"
    src = ROOT / "bench" / "tcp_baseline.c"
    if not tcp.exists() or tcp.stat().st_mtime < src.stat().st_mtime:
        subprocess.run([os.environ.get("CC", "cc"), "-std=c11", "-O2", "-Wall", "-Wextra", "-o",
                        str(tcp), str(src)], check=True)
    return tcp


def raw_tcp(lan: Lan, tcp: Path) -> dict[str, float | None]:
    """Bytes per second of raw TCP on each directed link: "a>b" (A to B) and so on. One run of
    tcp_baseline from A to B and one from the client to each server: the bulk stream is the
    upload ("a>b", "client>a"), 256 MiB answers the other way ("b>a", "a>client"), as
    bench/link_bench.py. A run that fails leaves its figures None."""
    got: dict[str, float | None] = {}
    for src, dst in (("a", "b"), ("client", "a"), ("client", "b")):
        proc = subprocess.run(["ip", "netns", "exec", lan.ns[src], str(tcp), "--server-netns",
                               lan.ns[dst], "--host", lan.ip(dst), "--quick", "--reps", "1"],
                              capture_output=True, text=True, timeout=600)
        try:
            r = json.loads(proc.stdout)
            got[f"{src}>{dst}"] = float(r["bulk_Bps"])
            got[f"{dst}>{src}"] = float(r["reqresp_Bps"][str(256 * MIB)])
        except (ValueError, KeyError):
            log(f"raw TCP {src} -> {dst} failed ({proc.returncode}): {proc.stderr.strip()}")
            got[f"{src}>{dst}"] = got[f"{dst}>{src}"] = None
    return got


def start_fleet(lan: Lan, database: str) -> tuple[dict[str, Server], str]:
    """gpupoold A and B on `database`, started, with a token made on A; once A sees the fleet's
    4 GPUs. The servers are in the dict as soon as they run (close them on failure too)."""
    servers: dict[str, Server] = {}
    try:
        for h in ("a", "b"):
            servers[h] = Server(lan, h, database)
        for s in servers.values():
            s.wait_started()
        a = servers["a"]
        made = subprocess.run([sys.executable, "-m", "gpupoold", "token", "create", "--name",
                               "spread-bench", "--database", database, "--state-dir",
                               str(a.state)], env=a.env, cwd=ROOT, capture_output=True, text=True,
                              check=True)
        token = made.stdout.strip().splitlines()[-1]
        wait("A sees the fleet's 4 GPUs", lambda: sorted(
            (v["state"], len(v["gpus"])) for v in a.get("/api/v1/fleet")["servers"])
            == [("up", 2), ("up", 2)])
    except BaseException:
        for s in servers.values():
            s.close()
        raise
    return servers, token


def client_env(a: Server, token: str, **more: str) -> dict[str, str]:
    """The environment of a client of GPUPOOL_GPUS=4 spread, naming and pinning A only."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPOOL_")}
    env.pop("LD_PRELOAD", None)
    env.update(LD_LIBRARY_PATH=str(BUILD / "client"), GPUPOOL_SERVER=a.address,
               GPUPOOL_TOKEN=token, GPUPOOL_CONFIG="none", GPUPOOL_TLS_FINGERPRINT=a.fingerprint,
               GPUPOOL_GPUS="4", GPUPOOL_SPREAD="1", GPUPOOL_COMPRESSION="off",
               GPUPOOL_CONNECT_TIMEOUT="60", **more)
    return env


def spread_copies(lan: Lan, a: Server, token: str, mib: int, reps: int,
                  path: str) -> tuple[dict[str, Any] | None, str]:
    """bench/spread_client.py in the client's namespace, naming and pinning A only, its copies
    across servers going `path` (GPUPOOL_SPREAD_COPY: "server" or "client"): its RESULT, or
    None and why not."""
    env = client_env(a, token, GPUPOOL_SPREAD_COPY=path)
    pairs = ",".join(f"{s}:{d}" for s, d in PAIRS)
    try:
        proc = subprocess.run(["ip", "netns", "exec", lan.ns["client"], sys.executable,
                               str(CLIENT), "--mib", str(mib), "--reps", str(reps), "--pairs",
                               pairs], env=env, capture_output=True, text=True, timeout=1800)
    except subprocess.TimeoutExpired:
        return None, "spread_client did not finish within 30 minutes"
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT ") and proc.returncode == 0:
            return json.loads(line[len("RESULT "):]), ""
    # The client's FAIL line and the shim's own lines about it (not its queue notices).
    said = [ln.strip() for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    fail = [ln for ln in said if ln.startswith("FAIL") or (
        ln.startswith("gpupool:") and "waiting for a GPU" not in ln)]
    return None, " / ".join((fail or said)[-3:]) or f"spread_client exited {proc.returncode}"


def gbit(bps: float | None) -> str:
    return "-" if bps is None else f"{bps * 8 / 1e9:.2f}"


def ratio(x: float | None, y: float | None) -> str:
    return "-" if x is None or y is None else f"{x / y:.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="1", help="shaped rates in Gbit/s, after the unshaped run "
                    "(\"\": unshaped only)")
    ap.add_argument("--client-rates", default="", help="then rates in Gbit/s of the client's "
                    "link alone, the servers' unshaped (a client behind a slower link than the "
                    "servers'; \"\": none)")
    ap.add_argument("--mib", type=int, default=256, help="size of each peer copy, in MiB")
    ap.add_argument("--reps", type=int, default=3, help="copies of each pair; the best counts")
    ap.add_argument("--database", help="the fleet's PostgreSQL URL, reachable from every "
                    "namespace (default: a PostgreSQL of the benchmark's own)")
    ap.add_argument("--markdown", type=Path)
    ap.add_argument("--json", type=Path, help="every figure, for tests")
    args = ap.parse_args()
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        sys.exit("spread_bench: needs root, ip and tc (network namespaces, a bridge, veth and tbf)")
    for need in (BUILD / "gpupool-worker", BUILD / "libgpupool-sim.so",
                 BUILD / "client" / "libcuda.so.1"):
        if not need.exists():
            sys.exit(f"spread_bench: {need} is missing: run `make` first")
    # (label, rate, the hosts shaped)
    every, client = tuple(HOSTS), ("client",)
    rates: list[tuple[str, float | None, tuple[str, ...]]] = [("unshaped", None, every)]
    rates += [(f"{float(r):g} Gbit/s", float(r), every) for r in args.rates.split(",") if r.strip()]
    rates += [(f"client {float(r):g} Gbit/s", float(r), client)
              for r in args.client_rates.split(",") if r.strip()]
    tcp = build_tcp()
    pg = None
    database = args.database
    if database is None:
        import pg_server

        why = pg_server.available()
        if why:
            sys.exit(f"spread_bench: needs PostgreSQL: {why}")
        pg = pg_server.PgServer()
        database = socket_url(pg)
    lan: Lan | None = None
    servers: dict[str, Server] = {}
    runs: list[dict[str, Any]] = []
    problems: list[str] = []
    try:
        lan = Lan()
        servers, token = start_fleet(lan, database)
        a = servers["a"]
        for label, rate, shaped in rates:
            lan.shape(rate, shaped)
            raw = raw_tcp(lan, tcp)
            log(f"{label}: raw TCP " + ", ".join(f"{k} {gbit(v)}" for k, v in raw.items())
                + " Gbit/s")
            run: dict[str, Any] = {"rate": rate, "label": label, "shaped": list(shaped),
                                   "raw": raw}
            # The same copies server to server, then through the client, one after the other.
            for key, path in (("spread_server", "server"), ("spread", "client")):
                wait("both servers' GPUs free", lambda: all(s.quiet() for s in servers.values()))
                result, why = spread_copies(lan, a, token, args.mib, args.reps, path)
                if result is None:
                    log(f"{label}: spread copies ({PATHS[key]}): not measured: {why}")
                run[key], run[f"{key}_error"] = result, why
            runs.append(run)
    finally:
        for s in servers.values():
            s.close()
        if lan is not None:
            lan.close()
        if pg is not None:
            pg.close()
    head = ("link", "copy", "path", "Gbit/s", "raw TCP A<->B", "x A<->B", "client legs",
            "x legs")
    body: list[tuple[str, ...]] = []
    notes: list[str] = []
    for run in runs:
        raw = run["raw"]
        for key, value in raw.items():
            if value is None:
                problems.append(f"{run['label']}: raw TCP {key}: not measured")
        for key in ("a>b", "b>a", "client>a", "a>client", "client>b", "b>client"):
            src, _, dst = key.partition(">")
            body.append((run["label"], f"raw TCP {NAMES[src]}->{NAMES[dst]}", "-",
                         gbit(raw[key]), "", "", "", ""))
        for key in ("spread_server", "spread"):
            result = run[key]
            if result is None:
                problems.append(f"{run['label']}: spread copies ({PATHS[key]}): not measured: "
                                f"{run[key + '_error']}")
                continue
            if result["devices"] != 4:
                problems.append(f"{run['label']}: {result['devices']} devices, not 4")
            for c in result["copies"]:
                src, dst = c["src"], c["dst"]
                if not c["exact"]:
                    problems.append(f"{run['label']}: copy {src}->{dst} ({PATHS[key]}) not "
                                    "bit-exact")
                if (src < 2) != (dst < 2):
                    hs, hd = ("a", "b") if src < 2 else ("b", "a")
                    direct = raw[f"{hs}>{hd}"]
                    legs = [raw[f"{hs}>client"], raw[f"client>{hd}"]]
                    leg = None if None in legs else min(v for v in legs if v is not None)
                    body.append((run["label"], f"peer {src}->{dst} ({NAMES[hs]}->{NAMES[hd]})",
                                 PATHS[key], gbit(c["bps"]), gbit(direct),
                                 ratio(c["bps"], direct), gbit(leg), ratio(c["bps"], leg)))
                elif key == "spread":  # within A: the same either way, shown once
                    body.append((run["label"], f"peer {src}->{dst} (within A)", "on the server",
                                 gbit(c["bps"]), "", "", "", ""))
        result = run["spread"] or run["spread_server"]
        if result is None:
            continue
        notes.append(f"{run['label']}: {result['devices']} devices, distinct pointer ranges, "
                     f"cuPointerGetAttribute right for each; every copy bit-exact "
                     f"({result['copies'][0]['bytes'] // MIB} MiB, best of "
                     f"{result['copies'][0]['reps']}); cuDeviceCanAccessPeer "
                     + ", ".join(f"{k.replace(':', ' to ')}: {v}"
                                 for k, v in result["can_access_peer"].items()))
    notes += [
        "server to server: the source server's worker streams to the destination server's worker "
        "over a link the two gpupoolds opened (AES-256-GCM records on TCP; GPUPOOL_SPREAD_COPY="
        "server); the client only orders the copy. Its bound is raw TCP A<->B.",
        "through the client: device-to-host from the source's server, host-to-device to the "
        "destination's (GPUPOOL_SPREAD_COPY=client, and auto's fallback when the servers cannot "
        "reach each other). It crosses the client's link twice, once each way: \"client legs\" "
        "is the slower of the two raw TCP legs (source server to client, client to destination "
        "server), its bound when the legs overlap (half of it when they do not).",
        "Unshaped, the CPU sets every figure (2 cores shared by 3 namespaces' processes: the "
        "servers' workers, the client, the TLS on each connection, the links' AES-GCM); "
        "shaped, the link does.",
        "The peer copy within A runs on the server (the simulated GPUs' memory copy): the "
        "reference of a peer copy on one server, with no network in it.",
    ]
    print(benchlib.text_table(head, body))
    print("\n".join(notes))
    if problems:
        print("\n".join(problems))
    lines = [f"### Spread leases ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
             f"{benchlib.cpu_model()}, {os.cpu_count()} CPUs, 2 x 2 simulated GPUs; three network "
             "namespaces on a bridge)", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head),
             *("| " + " | ".join(b) + " |" for b in body), "", *(f"- {n}" for n in notes),
             *(f"- NOT MEASURED: {p}" for p in problems)]
    benchlib.emit_markdown(lines, args.markdown)
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "problems": problems}, indent=1))
    return 1 if problems else 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # clean up the namespaces on SIGTERM
    sys.exit(main())
