#!/usr/bin/env python3
"""A fleet at data-centre scale on one machine (issue 34, item 1; docs/benchmarks.md, "Fleet at
scale").

    sudo .venv/bin/python bench/fleet_scale.py [--servers 50] [--gpus 8] [--clients 2000]
        [--loopback] [--hold-min S] [--hold-max S] [--json FILE] [--markdown FILE]

Starts one real PostgreSQL (tests/pg_server.py) and `--servers` gpupoold on it, `--gpus`
simulated GPUs each. Each server is in a network namespace of its own with its own address
(10.202.0.11 and on, a veth to a bridge at 10.202.0.1 that the benchmark makes and removes, as
bench/link_bench.py does; PostgreSQL through its Unix socket, which the namespaces share): root
and `ip` needed. With `--loopback`, for machines without namespaces, all of them on 127.0.0.1
with ports of their own. Then `--clients` light clients, in this one process: each is the wire
protocol's hello (the generated Python classes, the same frames as the shim), said to a server
picked at random, followed through redirects, and, once granted, a lease held for a random time
with no call, then a goodbye. Half of them arrive in a steady stream (a Poisson process at about
the rate the fleet's GPUs could serve), half in bursts of many at once, spread over the stream.
While it holds, a client pings every 0.25 s, but a share of them (`--idle-share`, a tenth)
stay silent for at least 2.5 times the servers' `idle_detach_after` (`--detach-after`, 1 s), so
that their leases are detached while others wait; their goodbye ends them detached.

It reports:
- hello to grant (the first connection's set-up to the hello reply that grants): p50, p99, max;
- grants per second the fleet sustained (first to last grant);
- PostgreSQL transactions and rows written (inserted + updated + deleted, pg_stat_database) per
  second at rest (every server up, no client) and per lease (all written during the run, and
  less the rest rate), and the fleet's connections;
- the fleet's locked sync (store/fleet.py): its duration when the daemon tells it in
  /api/v1/fleet (`sync_ms`), else that it is not measured;
- queue fairness: the most clients that arrived clearly later (`--fair-slack` seconds or more)
  and were granted sooner than one client (one token for all: the fleet's order is FIFO);
- double assignments from the shared lease history: two leases overlapping in time on the same
  server's GPU (must be 0; a detached lease has its GPU only while attached, from the lease
  events), and that each served client has exactly one lease; the leases detached; the GPUs'
  turnaround (a lease's end to the next lease's start on that GPU);
- memory (resident) and CPU per server, the workers' apart, and PostgreSQL's and the clients'
  CPU, and from these what limited the run.

Its last line sums it up: `servers N, clients served C of C, double assignments 0, grant p99 X
ms`. Exit status 1 when a GPU was given twice or a client was not served; `--json FILE` writes
every figure (tests/test_fleet_scale.py reads it).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import math
import os
import random
import resource
import shutil
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import benchlib  # noqa: E402
import gpupool_protocol as gp  # noqa: E402
from benchlib import BUILD, ROOT  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
PING_EVERY = 0.25  # seconds between the pings of a client that is not idle
VA_BASE = 0x200000000000  # the shim's default (client/shim/connect.c): free in every worker


def log(msg: str) -> None:
    print(f"fleet_scale: {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------ servers
NET = "10.202.0"  # the bridge is .1, server n is .(11 + n)
NS_PORT = 7070  # remoting in a server's namespace; HTTP the next port


def sh(*cmd: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")


class Lan:
    """A bridge here ({NET}.1) and a network namespace for each server with a veth on it;
    close() removes them (each veth goes with its namespace)."""

    def __init__(self, servers: int) -> None:
        if servers > 240:
            sys.exit("fleet_scale: at most 240 servers in namespaces (one /24); use --loopback")
        tag = os.getpid() % 100000
        self.bridge = f"gpsc{tag}"
        self.ns = [f"gpsc-{n}-{tag}" for n in range(servers)]
        self._undo: list[tuple[str, ...]] = []
        try:
            sh("ip", "link", "add", self.bridge, "type", "bridge")
            self._undo.append(("ip", "link", "del", self.bridge))
            sh("ip", "addr", "add", f"{NET}.1/24", "dev", self.bridge)
            sh("ip", "link", "set", self.bridge, "up")
            for n, ns in enumerate(self.ns):
                veth = f"gs{tag}v{n}"
                sh("ip", "netns", "add", ns)
                self._undo.append(("ip", "netns", "del", ns))
                sh("ip", "link", "add", veth, "type", "veth", "peer", "name", f"{veth}b")
                sh("ip", "link", "set", veth, "netns", ns)
                sh("ip", "link", "set", f"{veth}b", "master", self.bridge, "up")
                sh("ip", "-n", ns, "addr", "add", f"{self.address(n)}/24", "dev", veth)
                sh("ip", "-n", ns, "link", "set", veth, "up")
                sh("ip", "-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    @staticmethod
    def address(n: int) -> str:
        return f"{NET}.{11 + n}"

    def close(self) -> None:
        for cmd in reversed(self._undo):
            subprocess.run(cmd, capture_output=True, timeout=60)
        self._undo.clear()


class Server:
    """One gpupoold of the fleet: its own state dir, and its own ports on 127.0.0.1 or its own
    address in its namespace (`lan`), started without waiting (`ready` says when its HTTP
    listener is up)."""

    def __init__(self, n: int, gpus: int, config: str, env: dict[str, str],
                 lan: Lan | None = None) -> None:
        self.n, self.lan = n, lan
        self.name = f"scale-{n}"
        self.state = Path(tempfile.mkdtemp(prefix=f"gpupool-{self.name}-"))
        (self.state / "gpupoold.toml").write_text(config)
        self.log = self.state / "gpupoold.log"
        self.gpus, self.env, self.tries = gpus, env, 0
        self.start()

    def start(self) -> None:
        # Free ports as of now: another process may take one before gpupoold binds it (then
        # `ready` starts it again on others).
        self.tries += 1
        if self.lan is not None:
            host = self.lan.address(self.n)
            self.listen, self.http = f"{host}:{NS_PORT}", f"{host}:{NS_PORT + 1}"
        else:
            self.listen = f"127.0.0.1:{benchlib.free_port()}"
            self.http = f"127.0.0.1:{benchlib.free_port()}"
        cmd = [*(["ip", "netns", "exec", self.lan.ns[self.n]] if self.lan else []),
               sys.executable, "-m", "gpupoold", "serve", "--config",
               str(self.state / "gpupoold.toml"), "--simulated", str(self.gpus),
               "--listen", self.listen, "--http", self.http, "--state-dir", str(self.state),
               "--worker", str(BUILD / "gpupool-worker"),
               "--sim-lib", str(BUILD / "libgpupool-sim.so")]
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            if "address already in use" in self.text() and self.tries < 3:
                log(f"{self.name}: a port was taken meanwhile; starting it on others")
                self.start()
                return False
            lines = self.text().splitlines()
            why = [ln for ln in lines if " ERROR " in ln or " CRITICAL " in ln
                   or ln.startswith(("gpupoold:", "Traceback"))] or lines[-20:]
            sys.exit(f"fleet_scale: {self.name} exited at start (status "
                     f"{self.proc.returncode}):\n" + "\n".join(why[:30]))
        return "gpupoold: http on" in self.text()

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def fleet(self) -> Any:
        admin = (self.state / "local-admin.token").read_text().strip()
        # Off loopback gpupoold's API speaks HTTPS with the server's own identity (`http_tls`):
        # this reads the benchmark's own servers, so their certificate is not checked.
        scheme = "http" if self.lan is None else "https"
        req = urllib.request.Request(f"{scheme}://{self.http}/api/v1/fleet",
                                     headers={"Authorization": f"Bearer {admin}"})
        unchecked = ssl.create_default_context()
        unchecked.check_hostname, unchecked.verify_mode = False, ssl.CERT_NONE
        with urllib.request.urlopen(req, timeout=30, context=unchecked) as reply:
            return json.loads(reply.read())

    def usage(self) -> dict[str, float]:
        """CPU seconds of gpupoold (`cpu`) and of its reaped children, its workers and scrubs
        (`children`); resident bytes of gpupoold (`rss`, peak `hwm`) and of its live workers
        (`workers_rss`, every process of its group but itself)."""
        pid = self.proc.pid
        out = dict(zip(("cpu", "children"), proc_cpu(pid)))
        status = proc_status(pid)
        out["rss"], out["hwm"] = status.get("VmRSS", 0), status.get("VmHWM", 0)
        out["workers_rss"] = sum(proc_status(p).get("VmRSS", 0) for p in group_members(pid)
                                 if p != pid)
        return out

    def close(self) -> None:
        benchlib.stop_process_group(self.proc, 30)
        benchlib.remove_state(self.state)


def proc_cpu(pid: int) -> tuple[float, float]:
    """(utime + stime, cutime + cstime) of a process, in seconds; zeros once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, 0.0
    # After the command: state is fields[0]; utime, stime, cutime, cstime are stat's 14-17.
    return ((int(fields[11]) + int(fields[12])) / TICK, (int(fields[13]) + int(fields[14])) / TICK)


def proc_status(pid: int) -> dict[str, int]:
    """The kB figures of /proc/PID/status, in bytes."""
    out: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if value.strip().endswith(" kB"):
                out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def group_members(pgid: int) -> list[int]:
    found = []
    for pid in all_pids():
        try:
            if os.getpgid(pid) == pgid:
                found.append(pid)
        except OSError:
            pass
    return found


def postgres_cpu(pg: Any) -> float:
    """CPU seconds of the PostgreSQL server: the postmaster, its live processes and the ones it
    reaped."""
    try:
        postmaster = int((pg.data / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    total = sum(proc_cpu(postmaster))
    for pid in all_pids():
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == postmaster:
            total += proc_cpu(pid)[0]
    return total


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot (/proc/stat)."""
    first = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    ticks = [int(x) for x in first]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    return (sum(ticks) - idle) / TICK, sum(ticks) / TICK


# ----------------------------------------------------------------------------------- database
def pg_counters(url: str) -> tuple[int, int]:
    """(transactions committed, rows inserted + updated + deleted) of the fleet's database."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute("SELECT xact_commit, tup_inserted + tup_updated + tup_deleted "
                           "FROM pg_stat_database WHERE datname = current_database()").fetchone()
        assert row is not None
        return int(row[0]), int(row[1])


def pg_query(url: str, sql: str) -> list[Any]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        return list(conn.execute(sql).fetchall())


def occupancy(leases: list[Any], events: list[Any]) -> list[Any]:
    """When each lease had a GPU, as rows (id, server, gpu_index, from, to), from the shared
    history's leases (id, server, gpu_index, started, ended, ...) and their events (lease id,
    at, state, gpu_index): a lease is on its GPU from its start to its first `detached` event,
    then from each `attached` event (on that event's GPU) to the next `detached` or its end."""
    by_lease: dict[int, list[Any]] = {}
    for ev in sorted(events, key=lambda e: e[1]):
        by_lease.setdefault(ev[0], []).append(ev)
    out = []
    for lease_id, server, gpu, started, ended, *_ in leases:
        since: float | None = started
        for _id, at, state, on in by_lease.get(lease_id, []):
            if state == "detached" and since is not None:
                out.append((lease_id, server, gpu, since, at))
                since = None
            elif state == "attached" and since is None:
                gpu, since = on, at
        if since is not None:
            out.append((lease_id, server, gpu, since, ended))
    return out


def double_assignments(leases: list[Any]) -> list[str]:
    """Leases overlapping in time on the same server's GPU, from rows (id, server, gpu_index,
    from, to) of the shared history (`occupancy`): one line for each overlap."""
    found = []
    by_gpu: dict[tuple[str, int], list[Any]] = {}
    for row in leases:
        by_gpu.setdefault((row[1], row[2]), []).append(row)
    for (server, gpu), rows in sorted(by_gpu.items()):
        rows.sort(key=lambda r: r[3])
        for prev, nxt in zip(rows, rows[1:]):
            prev_end = prev[4] if prev[4] is not None else float("inf")
            if nxt[3] < prev_end:
                found.append(f"{server} GPU {gpu}: lease {nxt[0]} began at {nxt[3]:.3f} before "
                             f"lease {prev[0]} ended ({prev[4]})")
    return found


def turnarounds(leases: list[Any]) -> list[float]:
    """Seconds from a lease's end to the next lease's start on the same GPU (scrub, a new
    worker, the sync that grants it)."""
    by_gpu: dict[tuple[str, int], list[Any]] = {}
    for row in leases:
        by_gpu.setdefault((row[1], row[2]), []).append(row)
    gaps = []
    for rows in by_gpu.values():
        rows.sort(key=lambda r: r[3])
        gaps += [n[3] - p[4] for p, n in zip(rows, rows[1:]) if p[4] is not None]
    return gaps


# ------------------------------------------------------------------------------------ clients
@dataclass
class Client:
    n: int
    address: str  # the server it says its first hello to
    at: float  # seconds after the start at which it arrives
    hold: float  # seconds it holds its lease
    idle: bool = False  # silent while it holds (else a ping every PING_EVERY s): may be detached
    arrived: float = 0.0  # perf_counter at its first connect
    granted: float = 0.0  # perf_counter at the hello reply that granted
    hops: int = 0
    served_by: str = ""
    refused: str = ""


def hello_frame(token: str, pid: int) -> bytes:
    hello = gp.Hello(magic=gp.MAGIC, major=gp.MAJOR, minor=gp.MINOR, pid=pid, flags=0,
                     host="fleet-scale", user="bench", program="fleet_scale", token=token,
                     gpu="", model="", min_memory=0, va_base=VA_BASE, va_size=1 << 30)
    return gp.encode_frame(hello, 1)


def split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


async def hello_reply(reader: asyncio.StreamReader) -> Any:
    """Frames until the hello reply (the queue's notices before it are skipped)."""
    while True:
        length, op, flags, _ = gp.parse_header(await reader.readexactly(gp.HEADER_SIZE), 1 << 26)
        body = await reader.readexactly(length)
        if op == gp.Hello.OP and flags & gp.FLAG_REPLY:
            return gp.HelloReply.decode(body, allow_trailing=True)


async def run_client(c: Client, token: str, t0: float) -> None:
    await asyncio.sleep(max(0.0, t0 + c.at - time.perf_counter()))
    c.arrived = time.perf_counter()
    address = c.address
    pid = 10000 + c.n  # each client a process of its own, as the shim's are
    while True:
        try:
            reader, writer = await asyncio.open_connection(*split(address))
        except OSError as exc:
            c.refused = f"connect to {address}: {exc}"
            return
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        writer.write(hello_frame(token, pid))
        try:
            reply = await hello_reply(reader)
        except (OSError, asyncio.IncompleteReadError) as exc:
            c.refused = f"{address} closed before its hello reply: {exc!r}"
            writer.close()
            return
        if reply.result == gp.GP_EREDIRECT:
            writer.close()
            c.hops += 1
            address = reply.redirect
            continue
        if reply.result != 0:
            c.refused = f"{address}: {reply.result} {reply.message}"
            writer.close()
            return
        c.granted = time.perf_counter()
        c.served_by = address
        break
    until = time.perf_counter() + c.hold
    try:
        while not c.idle and time.perf_counter() + PING_EVERY < until:
            await asyncio.sleep(PING_EVERY)  # (the worker's replies are read with the goodbye's)
            writer.write(gp.encode_frame(gp.Ping(token=1), 3))
        await asyncio.sleep(max(0.0, until - time.perf_counter()))
        writer.write(gp.encode_frame(gp.Goodbye(), 2))
        await writer.drain()
        # The worker answers the goodbye and closes: the lease is over on its side.
        await asyncio.wait_for(reader.read(), 30)
    except (TimeoutError, OSError):
        pass
    writer.close()


def schedule(args: argparse.Namespace, servers: list[Server], rng: random.Random) -> list[Client]:
    """Half the clients in a steady stream (exponential gaps) at about the rate the fleet's GPUs
    serve them, half in `--bursts` bursts of many at once spread over the stream."""
    mean_hold = (args.hold_min + args.hold_max) / 2
    gpus = args.servers * args.gpus
    rate = args.rate or gpus / (mean_hold + args.turnaround)
    steady = args.clients - args.clients // 2
    times, t = [], 0.0
    for _ in range(steady):
        t += rng.expovariate(rate)
        times.append(t)
    span = t
    bursty = args.clients - steady
    bursts = max(1, min(args.bursts, bursty))
    for k in range(bursts):
        at = span * k / bursts
        times += [at] * (bursty // bursts + (k < bursty % bursts))
    times.sort()
    clients = [Client(n, rng.choice(servers).listen, at,
                      rng.uniform(args.hold_min, args.hold_max)) for n, at in enumerate(times)]
    if args.detach_after > 0:
        # Idle ones hold long enough to be detached while others wait (detach_policy
        # when-queued), and come back for their goodbye.
        for c in rng.sample(clients, round(args.idle_share * len(clients))):
            c.idle, c.hold = True, max(c.hold, 2.5 * args.detach_after)
    return clients


async def run_clients(clients: list[Client], token: str) -> None:
    t0 = time.perf_counter()
    await asyncio.gather(*(run_client(c, token, t0) for c in clients))


# ----------------------------------------------------------------------------------- analysis
def percentile(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)  # the nearest rank: the smallest value with p % of them at or below it
    return xs[min(len(xs) - 1, max(0, math.ceil(p / 100 * len(xs)) - 1))]


def overtaking(clients: list[Client], slack: float) -> int:
    """The most clients that arrived at least `slack` seconds after one client and were granted
    before it (0: FIFO to within `slack`)."""
    served = sorted((c for c in clients if c.granted), key=lambda c: c.arrived)
    arrivals = [c.arrived for c in served]
    grants = sorted(c.granted for c in served)
    rank = {id(c): bisect.bisect_left(grants, c.granted) for c in served}
    tree = [0] * (len(served) + 1)  # Fenwick tree over grant ranks of the later arrivals

    def add(i: int) -> None:
        i += 1
        while i < len(tree):
            tree[i] += 1
            i += i & -i

    def below(i: int) -> int:  # how many added have a grant rank < i
        s = 0
        while i > 0:
            s += tree[i]
            i -= i & -i
        return s

    worst, j = 0, len(served)
    for i in range(len(served) - 1, -1, -1):
        c = served[i]
        # Add every client that arrived `slack` or more after c.
        while j > 0 and arrivals[j - 1] >= c.arrived + slack:
            j -= 1
            add(rank[id(served[j])])
        worst = max(worst, below(rank[id(c)]))
    return worst


def sync_figures(servers: list[Server]) -> str:
    """The locked sync's duration as the servers tell it, or why it is not known."""
    try:
        views = [s.fleet() for s in servers]
    except OSError as exc:
        return f"not read ({exc})"
    got = [v["sync_ms"] for v in views if isinstance(v.get("sync_ms"), dict)]
    if not got:
        return "not measured: gpupoold does not tell the sync's duration (/api/v1/fleet)"
    p50 = statistics.median(g["p50"] for g in got)
    p99 = max(g["p99"] for g in got)
    return f"p50 {p50:.1f} ms (median of the servers'), p99 {p99:.1f} ms (worst server's)"


def limits(cpu: dict[str, float], wall: float, busy: float, cores: int) -> str:
    """What limited the run, from where the CPU went."""
    ours = sum(cpu.values())
    share = ", ".join(f"{k} {v:.0f} s" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1]))
    others = max(0.0, busy - ours)
    if busy >= 0.85 * wall * cores:
        top = max(cpu, key=lambda k: cpu[k])
        return (f"the CPU: the machine's {cores} cores were {busy / (wall * cores):.0%} busy "
                f"({share}; others' work on this machine {others:.0f} s); the most went to "
                f"{top}")
    return (f"not the CPU ({busy / (wall * cores):.0%} busy: {share}; others {others:.0f} s): the "
            f"clients' holds and each GPU's turnaround between leases")


# --------------------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--servers", type=int, default=50)
    ap.add_argument("--gpus", type=int, default=8, help="simulated GPUs per server")
    ap.add_argument("--clients", type=int, default=2000)
    ap.add_argument("--loopback", action="store_true",
                    help="every server on 127.0.0.1 (no network namespaces: no root needed)")
    ap.add_argument("--hold-min", type=float, default=0.5, help="shortest hold, seconds")
    ap.add_argument("--hold-max", type=float, default=3.0, help="longest hold, seconds")
    ap.add_argument("--turnaround", type=float, default=0.5,
                    help="seconds a GPU is assumed to need between leases (the stream's rate)")
    ap.add_argument("--rate", type=float, default=0.0,
                    help="the stream's clients per second (default: what the GPUs could serve)")
    ap.add_argument("--bursts", type=int, default=4)
    ap.add_argument("--idle-share", type=float, default=0.1,
                    help="share of the clients silent while they hold (the others ping)")
    ap.add_argument("--detach-after", type=float, default=1.0,
                    help="the servers' idle_detach_after, seconds (0: no idle detach)")
    ap.add_argument("--fair-slack", type=float, default=0.25,
                    help="arrivals this many seconds apart count for fairness")
    ap.add_argument("--rest", type=float, default=5.0, help="seconds measured at rest")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--markdown", type=Path)
    args = ap.parse_args()
    if not args.loopback and (os.geteuid() != 0 or not shutil.which("ip")):
        sys.exit("fleet_scale: a server per network namespace needs root and ip (iproute2); "
                 "run with sudo, or with --loopback")
    import pg_server

    why = pg_server.available()
    if why:
        sys.exit(f"fleet_scale: needs PostgreSQL: {why}")
    need = args.clients * 2 + args.servers * 16 + 64
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:  # a socket per client, and one for each of its redirects
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
    rng = random.Random(args.seed)
    pg = pg_server.PgServer()
    lan: Lan | None = None
    servers: list[Server] = []
    result: dict[str, Any] = {"servers": args.servers, "gpus": args.gpus,
                              "clients": args.clients}
    try:
        url = pg.new_database()
        # From a namespace 127.0.0.1 is its own: the servers there use the Unix socket.
        lan = None if args.loopback else Lan(args.servers)
        db_name = url.rsplit("/", 1)[1]
        server_url = url if lan is None else \
            f"postgresql://{pg_server.ROLE}@/{db_name}?host={pg.dir}&port={pg.port}"
        config = (f'database = "{server_url}"\n{benchlib.plain_tcp_server_config()}'
                  'reset_policy = "never"\nsim_memory_gib = 1\n'
                  f"max_queue = {args.clients + 16}\nmax_queue_per_token = 0\n"
                  f"queue_timeout = 3600\nidle_detach_after = {args.detach_after}\n")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT), str(ROOT / "protocol" / "python"),
             *filter(None, [env.get("PYTHONPATH")])])
        t_start = time.monotonic()
        # The first creates the schema; the others start once it is there (no race on it).
        servers.append(Server(0, args.gpus, config, env, lan))
        while not servers[0].ready():
            time.sleep(0.1)
        servers += [Server(n, args.gpus, config, env, lan) for n in range(1, args.servers)]
        deadline = time.monotonic() + 120 + 3 * args.servers
        while not all(s.ready() for s in servers):
            if time.monotonic() > deadline:
                sys.exit("fleet_scale: servers did not start in time")
            time.sleep(0.25)
        total = args.servers * args.gpus
        while True:
            free = pg_query(url, "SELECT count(*) FROM fleet_gpus WHERE free = 1")[0][0]
            if free == total:
                break
            if time.monotonic() > deadline:
                sys.exit(f"fleet_scale: only {free} of {total} GPUs free in the fleet")
            time.sleep(0.5)
        result["start_s"] = time.monotonic() - t_start
        log(f"{args.servers} servers, {total} GPUs up in {result['start_s']:.0f} s")
        made = subprocess.run([sys.executable, "-m", "gpupoold", "token", "create", "--name",
                               "fleet-scale", "--database", url, "--state-dir",
                               str(servers[0].state)],
                              env=env, cwd=ROOT, capture_output=True, text=True, check=True)
        token = made.stdout.strip().splitlines()[-1]
        # At rest: heartbeats and the periodic syncs of every server.
        x0, r0, w0 = *pg_counters(url), time.monotonic()
        time.sleep(args.rest)
        x1, r1 = pg_counters(url)
        rest = time.monotonic() - w0
        result["rest_xact_per_s"] = (x1 - x0) / rest
        # Connections to the fleet's database (max_connections bounds the fleet's size), less
        # the benchmark's own.
        result["pg_connections"] = pg_query(url, "SELECT count(*) FROM pg_stat_activity "
                                                 "WHERE datname = current_database()")[0][0] - 1
        result["rest_rows_per_s"] = (r1 - r0) / rest
        log(f"at rest: {result['rest_xact_per_s']:.0f} transactions/s, "
            f"{result['rest_rows_per_s']:.0f} rows written/s")

        clients = schedule(args, servers, rng)
        before = {s.name: s.usage() for s in servers}
        pg_cpu0, bench0, (busy0, _) = postgres_cpu(pg), os.times(), machine_busy()
        w0 = time.monotonic()
        log(f"{args.clients} clients over {clients[-1].at:.0f} s")
        asyncio.run(run_clients(clients, token))
        # Every lease recorded as ended (the last goodbyes are being processed).
        while pg_query(url, "SELECT count(*) FROM leases WHERE ended IS NULL")[0][0]:
            if time.monotonic() - w0 > 600 + clients[-1].at:
                break
            time.sleep(0.2)
        wall = time.monotonic() - w0
        x2, r2 = pg_counters(url)
        after = {s.name: s.usage() for s in servers}
        bench1, (busy1, _) = os.times(), machine_busy()
        cpu = {"gpupoold (Python)": sum(after[n]["cpu"] - before[n]["cpu"] for n in after),
               "workers and scrubs (C)": sum(after[n]["children"] - before[n]["children"]
                                             for n in after),
               "PostgreSQL": postgres_cpu(pg) - pg_cpu0,
               "the clients (this process)": (bench1.user + bench1.system)
               - (bench0.user + bench0.system)}
        result["sync"] = sync_figures(servers)
        leases = pg_query(url, "SELECT id, server, gpu_index, started, ended, client_pid "
                               "FROM leases")
        events = pg_query(url, "SELECT lease_id, at, state, gpu_index FROM lease_events "
                               "WHERE state IN ('detached', 'attached')")
    finally:
        for s in servers:
            s.close()
        if lan is not None:
            lan.close()
        pg.close()

    served = [c for c in clients if c.granted]
    waits = [(c.granted - c.arrived) * 1000 for c in served]
    grants = sorted(c.granted for c in served)
    occupied = occupancy(leases, events)
    doubles = double_assignments(occupied)
    per_client = {}
    for row in leases:
        per_client[row[5]] = per_client.get(row[5], 0) + 1
    not_once = [c.n for c in served if per_client.get(10000 + c.n) != 1]
    gaps = turnarounds(occupied)
    n_leases = max(1, len(leases))
    result.update({
        "served": len(served), "refused": [c.refused for c in clients if c.refused][:20],
        "leases": len(leases), "detaches": sum(1 for e in events if e[2] == "detached"),
        "idle_clients": sum(1 for c in clients if c.idle),
        "double_assignments": len(doubles), "doubles": doubles[:20],
        "served_not_once": len(not_once),
        "grant_ms": {"p50": percentile(waits, 50), "p99": percentile(waits, 99),
                     "max": max(waits, default=float("nan"))},
        "redirected": sum(1 for c in served if c.hops),
        # More than one redirect: the GPU held for it was given to another meanwhile (its hold
        # ran out before its hello reached that server) or its server could not take it back.
        "redirected_again": sum(1 for c in served if c.hops > 1),
        "grants_per_s": (len(grants) - 1) / (grants[-1] - grants[0]) if len(grants) > 1 else 0,
        "run_s": wall,
        # Everything the run wrote, per lease; and less the rest rate (background syncs and
        # heartbeats), which overstates the background when the servers were too busy to sync
        # as often as at rest (then the gross figure is the one to read).
        "xact_per_lease_gross": (x2 - x1) / n_leases,
        "rows_per_lease_gross": (r2 - r1) / n_leases,
        "xact_per_lease": (x2 - x1 - result["rest_xact_per_s"] * wall) / n_leases,
        "rows_per_lease": (r2 - r1 - result["rest_rows_per_s"] * wall) / n_leases,
        "overtaking": overtaking(clients, args.fair_slack), "fair_slack_s": args.fair_slack,
        "turnaround_ms": {"p50": percentile(gaps, 50) * 1000, "p99": percentile(gaps, 99) * 1000},
        "cpu_s": cpu,
        "per_server": {
            "gpupoold_rss_mib": statistics.mean(a["rss"] for a in after.values()) / 2**20,
            "gpupoold_peak_rss_mib": max(a["hwm"] for a in after.values()) / 2**20,
            "workers_rss_mib": statistics.mean(a["workers_rss"] for a in after.values()) / 2**20,
            "gpupoold_cpu_s": cpu["gpupoold (Python)"] / args.servers,
            "workers_cpu_s": cpu["workers and scrubs (C)"] / args.servers},
        "limit": limits(cpu, wall, busy1 - busy0, os.cpu_count() or 1),
        "machine": f"{benchlib.cpu_model()}, {os.cpu_count()} cores",
        "mode": "loopback" if args.loopback else "namespaces",
        "date": time.strftime("%Y-%m-%d"),
    })
    ps = result["per_server"]
    body = [
        ("hello to grant p50 / p99 / max", f"{result['grant_ms']['p50']:.0f} / "
         f"{result['grant_ms']['p99']:.0f} / {result['grant_ms']['max']:.0f} ms"),
        ("grants per second sustained", f"{result['grants_per_s']:.1f}"),
        ("clients redirected to another server / more than once",
         f"{result['redirected']} / {result['redirected_again']}"),
        ("GPU turnaround, lease end to next start, p50 / p99",
         f"{result['turnaround_ms']['p50']:.0f} / {result['turnaround_ms']['p99']:.0f} ms"),
        ("PostgreSQL per lease, all / less the rest rate: transactions",
         f"{result['xact_per_lease_gross']:.1f} / {result['xact_per_lease']:.1f}"),
        ("PostgreSQL per lease, all / less the rest rate: rows written",
         f"{result['rows_per_lease_gross']:.1f} / {result['rows_per_lease']:.1f}"),
        ("PostgreSQL at rest: transactions / rows written per s",
         f"{result['rest_xact_per_s']:.0f} / {result['rest_rows_per_s']:.0f}"),
        ("PostgreSQL connections of the fleet (at rest)", f"{result['pg_connections']}"),
        ("locked fleet sync", result["sync"]),
        (f"queue fairness: most overtaken by (arrivals {args.fair_slack:g} s apart)",
         f"{result['overtaking']}"),
        ("idle clients / leases detached", f"{result['idle_clients']} / {result['detaches']}"),
        ("double assignments (shared lease history)", f"{result['double_assignments']}"),
        ("per server: gpupoold RSS mean / peak, its workers' RSS",
         f"{ps['gpupoold_rss_mib']:.0f} / {ps['gpupoold_peak_rss_mib']:.0f} MiB, "
         f"{ps['workers_rss_mib']:.0f} MiB"),
        ("per server: CPU of gpupoold / of its workers and scrubs",
         f"{ps['gpupoold_cpu_s']:.1f} / {ps['workers_cpu_s']:.1f} s"),
    ]
    lines = [
        f"fleet_scale: {result['date']}, {result['machine']}, {args.servers} servers x "
        f"{args.gpus} simulated GPUs ({'loopback' if args.loopback else 'a namespace each'}), "
        f"{args.clients} clients, holds "
        f"{args.hold_min:g}-{args.hold_max:g} s, run {wall:.0f} s, fleet up in "
        f"{result['start_s']:.0f} s",
        benchlib.text_table(("figure", "value"), body),
        f"limited by {result['limit']}",
    ]
    benchlib.emit_markdown(lines, args.markdown)
    for line in doubles[:20]:
        print(f"double assignment: {line}")
    for why in result["refused"]:
        print(f"not served: {why}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    ok = not doubles and len(served) == args.clients and not not_once
    print(f"servers {args.servers}, clients served {len(served)} of {args.clients}, double "
          f"assignments {len(doubles)}, grant p99 {result['grant_ms']['p99']:.0f} ms")
    return 0 if ok else 1


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally: stops the fleet
    sys.exit(main())
