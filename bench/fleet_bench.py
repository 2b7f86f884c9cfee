#!/usr/bin/env python3
"""What a fleet costs a client and the database (docs/benchmarks.md, "Fleet").

    .venv/bin/python bench/fleet_bench.py [--rounds N] [--markdown FILE]

Starts a real PostgreSQL (tests/pg_server.py) and, on simulated GPUs with one GPU each:
- one gpupoold on SQLite: the single-server reference;
- two gpupoold on one PostgreSQL database (a fleet), the client always naming server A.

It measures, for a client that says hello (Python, the same frames as the shim):
- connect to first reply with A's GPU free (local), with A's GPU held and B's free (the reply is
  GP_EREDIRECT; the client connects to B and says hello again: the time to B's snapshot), and with
  both held (queued: the first GP_INFO_QUEUED notice);
- a plain TCP connect + one round trip to the same port, the floor of any set-up (raw TCP on the
  same link), so that "a redirect adds at most one extra connection set-up" can be read off;
  the client speaks the plaintext protocol on its own sockets, so the daemons run with
  `tls = "off"` (TLS, gpupoold's default, would add its handshakes to every figure);
- PostgreSQL transactions per lease (pg_stat_database, the fleet's background syncs and
  heartbeats measured over an idle window first and subtracted).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import benchlib  # noqa: E402
import gpupool_protocol as gp  # noqa: E402
from benchlib import ROOT, Daemon  # noqa: E402

VA_BASE = 0x200000000000  # the shim's default (client/shim/connect.c): free in every worker


def log(msg: str) -> None:
    print(f"fleet_bench: {msg}", file=sys.stderr, flush=True)


def split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def read_frame(sock: socket.socket) -> tuple[int, int, bytes]:
    def exact(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            got = sock.recv(n - len(buf))
            if not got:
                raise ConnectionError("closed")
            buf += got
        return buf
    length, op, flags, _ = gp.parse_header(exact(gp.HEADER_SIZE), 1 << 26)
    return op, flags, exact(length)


_pids = iter(range(1000, 1 << 30))


def hello_frame(token: str, pid: int) -> bytes:
    hello = gp.Hello(magic=gp.MAGIC, major=gp.MAJOR, minor=gp.MINOR, pid=pid, flags=0,
                     host="fleet-bench", user="bench", program="fleet_bench", token=token,
                     gpu="", model="", min_memory=0, va_base=VA_BASE, va_size=1 << 30)
    return gp.encode_frame(hello, 1)


class Session:
    """One hello, followed through redirects; `first` the seconds to the first frame, `reply`
    to the hello reply that ends it, `hops` the redirects followed."""

    def __init__(self, address: str, token: str, until_first: bool = False) -> None:
        self.hops = 0
        t0 = time.perf_counter()
        self.first = 0.0
        pid = next(_pids)  # each session a process of its own, as the shim's are
        while True:
            sock = socket.create_connection(split(address), timeout=60)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(hello_frame(token, pid))
            while True:
                op, flags, body = read_frame(sock)
                if not self.first:
                    self.first = time.perf_counter() - t0
                    if until_first:
                        self.sock = sock
                        return
                if op == gp.Hello.OP and flags & gp.FLAG_REPLY:
                    break
            reply = gp.HelloReply.decode(body, allow_trailing=True)
            if reply.result == gp.GP_EREDIRECT:
                sock.close()
                self.hops += 1
                address = reply.redirect
                self.first = 0.0
                continue
            if reply.result != 0:
                raise RuntimeError(f"refused: {reply.message}")
            self.reply = time.perf_counter() - t0
            self.sock = sock
            return

    def close(self) -> None:
        try:
            self.sock.sendall(gp.encode_frame(gp.Goodbye(), 2))
        except OSError:
            pass
        self.sock.close()


def tcp_round_trip(address: str) -> float:
    """Connect, send a first frame that is not a hello (a ping), read the daemon's refusal: a
    set-up and one round trip to the same listener, with no GPU, worker or database involved."""
    t0 = time.perf_counter()
    with socket.create_connection(split(address), timeout=30) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(gp.encode_frame(gp.Ping(token=1), 1))
        read_frame(sock)
    return time.perf_counter() - t0


def median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1000


def wait_free(d: Daemon) -> None:
    d.wait_quiet()


def transactions(url: str) -> int:
    import psycopg
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute("SELECT xact_commit + xact_rollback FROM pg_stat_database "
                           "WHERE datname = current_database()").fetchone()
        return int(row[0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--markdown", type=Path)
    args = ap.parse_args()
    import pg_server

    why = pg_server.available()
    if why:
        sys.exit(f"fleet_bench: needs PostgreSQL: {why}")
    pg = pg_server.PgServer()
    url = pg.new_database()
    # Plain TCP on the remoting ports, said explicitly: the sessions below speak the plaintext
    # protocol on raw sockets (see the top).
    plain = 'tls = "off"\n'
    single = Daemon(1, name="fleet-single", config=plain)
    a = b = None
    try:
        a = Daemon(1, name="fleet-a", config=f'database = "{url}"\n{plain}')
        b = Daemon(1, name="fleet-b", config=f'database = "{url}"\n{plain}')
        made = subprocess.run([sys.executable, "-m", "gpupoold", "token", "create", "--name",
                               "fleet-bench", "--database", url, "--state-dir", str(a.state)],
                              env=a.env, cwd=ROOT, capture_output=True, text=True, check=True)
        token = made.stdout.strip().splitlines()[-1]
        rows: dict[str, list[float]] = {k: [] for k in (
            "tcp", "single", "local", "redirect", "queued")}
        hops = []
        for d in (single, a, b):
            wait_free(d)
        log(f"{args.rounds} rounds")
        for n in range(args.rounds):
            rows["tcp"].append(tcp_round_trip(a.listen))
            s = Session(single.listen, single.token)
            rows["single"].append(s.reply)
            s.close()
            s = Session(a.listen, token)
            rows["local"].append(s.reply)
            s.close()
            for d in (single, a, b):
                wait_free(d)
            holder = Session(a.listen, token)  # A's GPU taken: the next one goes to B
            s = Session(a.listen, token)
            rows["redirect"].append(s.reply)
            hops.append(s.hops)
            queued = Session(a.listen, token, until_first=True)  # both taken: it waits
            rows["queued"].append(queued.first)
            queued.close()
            s.close()
            holder.close()
            for d in (a, b):
                wait_free(d)
            log(f"round {n + 1}: local {rows['local'][-1] * 1000:.1f} ms, redirect "
                f"{rows['redirect'][-1] * 1000:.1f} ms ({hops[-1]} hop)")
        # Database transactions per lease: the idle rate first (heartbeats, syncs).
        idle_s = 5.0
        for _ in range(3):
            t0, s0 = transactions(url), [d.get("/api/v1/fleet")["syncs"] for d in (a, b)]
            time.sleep(idle_s)
            idle = (transactions(url) - t0) / idle_s
            s1 = [d.get("/api/v1/fleet")["syncs"] for d in (a, b)]
            log(f"idle: {idle:.1f} transactions/s, syncs/s {[(y - x) / idle_s for x, y in zip(s0, s1)]}")
        leases = 20
        t0, w0 = transactions(url), time.monotonic()
        for _ in range(leases):
            s = Session(a.listen, token)
            s.close()
            wait_free(a)
        spent = time.monotonic() - w0
        per_lease = (transactions(url) - t0 - idle * spent) / leases
    finally:
        for d in (single, a, b):
            if d is not None:
                d.close()
        pg.close()
    tcp = median_ms(rows["tcp"])
    body = [
        ("plain TCP connect + one round trip (reference)", f"{tcp:.2f}", ""),
        ("single server (SQLite), GPU free", f"{median_ms(rows['single']):.2f}", ""),
        ("fleet, GPU of the named server free", f"{median_ms(rows['local']):.2f}", ""),
        ("fleet, redirected to the other server", f"{median_ms(rows['redirect']):.2f}",
         f"+{median_ms(rows['redirect']) - median_ms(rows['local']):.2f} over local "
         f"({max(hops)} hop)"),
        ("fleet, queued (first queue notice)", f"{median_ms(rows['queued']):.2f}", ""),
    ]
    lines = [
        f"fleet_bench: {time.strftime('%Y-%m-%d')}, {benchlib.cpu_model()}, "
        f"{args.rounds} rounds (medians)",
        benchlib.text_table(("connect to first reply", "ms", "note"), body),
        f"a redirect adds {median_ms(rows['redirect']) - median_ms(rows['local']):.2f} ms over "
        f"the local figure; one whole connection set-up is {median_ms(rows['local']):.2f} ms "
        f"(target: at most one extra set-up)",
        f"PostgreSQL transactions per lease (fleet of 2, background {idle:.1f}/s subtracted): "
        f"{per_lease:.1f}; a single server on SQLite: 0",
    ]
    benchlib.emit_markdown(lines, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
