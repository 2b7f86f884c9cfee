#!/usr/bin/env python3
"""The daemon benchmark: connect-to-first-reply time and control-plane responsiveness.

    python bench/daemon_bench.py [--quick] [--markdown PATH]

In one run, on simulated GPUs over loopback (needs the native build in build/ and nvcc's
cuda.h for the test client):
  1. connect time: tests/clients/hold_gpu is run N times one after the other; the figure is the
     client's own time for cuInit (TCP connect, hello, token check, lease, hand-over to the worker,
     the hello reply with the device snapshot), with pre-started workers (the default) and
     without (`prestart_workers = false`). Reference: a raw TCP connect plus one 64-byte round
     trip to a Python echo server on the same loopback, measured in the same run.
  2. recovery: a client streaming copies is killed with SIGKILL; the time until its GPU is free
     again (lease ended as "client lost", memory scrubbed, health checked), target 3 s.
  3. client side: the `info` request that `gpupool status/smi/doctor` and the NVML
     library send (connect, token check, the server's state as JSON), next to the raw TCP
     reference; and the connect time of (1) with two servers configured, where each new process
     first asks both for their state to pick one (server selection), next to one server.
  4. responsiveness: `/healthz` is fetched back to back (one connection at a time, as a
     monitoring probe does) while 2 clients stream 64 MiB device-to-host copies on the 2 GPUs and
     6 more wait in the queue; p50/p99/max, next to the same probe on the idle daemon.
Prints a table and a markdown section for docs/benchmarks.md. Targets are reported, not enforced.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402 - bench/ is not a package

BUILD = ROOT / "build"
MIB = 1 << 20


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def build_client() -> Path:
    out = BUILD / "bench" / "hold_gpu"
    src = ROOT / "tests" / "clients" / "hold_gpu.c"
    shim = BUILD / "client" / "libcuda.so.1"
    out.parent.mkdir(parents=True, exist_ok=True)
    cuda_inc = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include"
    subprocess.run([os.environ.get("CC", "cc"), "-std=c11", "-O2", f"-I{cuda_inc}", "-o",
                    str(out), str(src), str(shim)], check=True)
    return out


class Daemon:
    def __init__(self, gpus: int, config: str = "") -> None:
        self.state = Path(tempfile.mkdtemp(prefix="gpupool-dbench-"))
        env = dict(os.environ)
        # Keep a PYTHONPATH given from outside (e.g. a sitecustomize that profiles the daemon).
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "protocol" / "python"),
                                             *filter(None, [env.get("PYTHONPATH")])])
        self.env = env
        cfg = self.state / "gpupoold.toml"
        cfg.write_text(config)
        cmd = [sys.executable, "-m", "gpupoold", "serve", "--config", str(cfg), "--simulated",
               str(gpus), "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--state-dir",
               str(self.state), "--worker", str(BUILD / "gpupool-worker"), "--sim-lib",
               str(BUILD / "libgpupool-sim.so")]
        self.log_path = self.state / "log"
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log_path.open("w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        self.address = self.http = ""
        identity: str | None | bool = False
        while time.monotonic() < deadline and not self.http:
            text = self.log_path.read_text()
            for line in text.splitlines():
                if line.startswith("gpupoold: remoting on "):
                    self.address = line.split()[-1]
                if line.startswith("gpupoold: http on "):
                    self.http = line.split()[-1]
            identity = benchlib.identity_line(text)
            time.sleep(0.05)
        if not self.http or identity is False:
            output = self.log_path.read_text()  # stop() removes the state directory with it
            self.stop()
            sys.exit("daemon_bench: gpupoold did not start:\n" + output)
        # The identity its clients pin (TLS, gpupoold's default; None with tls = "off").
        self.fingerprint: str | None = identity or None
        made = subprocess.run([sys.executable, "-m", "gpupoold", "token", "create", "--name",
                               "bench", "--state-dir", str(self.state)], env=env, cwd=ROOT,
                              capture_output=True, text=True, check=True)
        self.token = made.stdout.strip().splitlines()[-1]
        self.admin = (self.state / "local-admin.token").read_text().strip()
        self.prestart = "prestart_workers = false" not in config
        self.wait_free(gpus)

    def get(self, path: str) -> tuple[int, bytes]:
        host, port = self.http.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        try:
            conn.request("GET", path, headers={"Authorization": f"Bearer {self.admin}"})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def wait_free(self, n: int, timeout: float = 60) -> None:
        import json

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            gpus = json.loads(self.get("/api/v1/gpus")[1])["gpus"]
            if sum(g["state"] == "free" and (g["worker_ready"] or not self.prestart)
                   for g in gpus) >= n:
                return
            time.sleep(0.01)
        raise RuntimeError("GPUs did not become free")

    def client_env(self) -> dict[str, str]:
        env = dict(os.environ)
        for var in ("GPUPOOL_TLS", "GPUPOOL_TLS_FINGERPRINT", "GPUPOOL_TLS_CA"):
            env.pop(var, None)
        env["LD_LIBRARY_PATH"] = str(BUILD / "client")
        env["GPUPOOL_SERVER"] = self.address
        env["GPUPOOL_TOKEN"] = self.token
        env.update(benchlib.trust_env(self.fingerprint))
        return env

    def config_entry(self) -> str:
        """This daemon's [[servers]] entry for a client's configuration file, pinned."""
        trust = (f'tls_fingerprint = "{self.fingerprint}"' if self.fingerprint
                 else "tls = false")
        return f'[[servers]]\naddress = "{self.address}"\ntoken = "{self.token}"\n{trust}\n'


    def stop(self) -> None:
        benchlib.stop_process_group(self.proc, 30)
        benchlib.remove_state(self.state)


def parse_facts(out: str) -> dict[str, str]:
    line = [ln for ln in out.splitlines() if "uuid=" in ln][-1]
    return dict(kv.split("=", 1) for kv in line.split())


def connect_times(client: Path, n: int, prestart: bool) -> list[float]:
    d = Daemon(1, "" if prestart else "prestart_workers = false\n")
    try:
        times = []
        for _ in range(n):
            proc = subprocess.run([str(client), str(MIB), "0", "1"], env=d.client_env(),
                                  capture_output=True, text=True, timeout=60)
            if proc.returncode != 0:
                raise RuntimeError(proc.stderr)
            f = parse_facts(proc.stdout)
            times.append(float(f["t_leased"]) - float(f["t_start"]))
            d.wait_free(1)
        return times
    finally:
        d.stop()


def kill_to_free(client: Path, n: int) -> list[float]:
    import json

    d = Daemon(1)
    try:
        out = []
        for i in range(n):
            proc = subprocess.Popen([str(client), str(64 * MIB), "60000", str(i + 1), "1000000000"],
                                    env=d.client_env(), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
            assert proc.stdout is not None
            if "holding" not in proc.stdout.readline():
                raise RuntimeError(proc.communicate()[1])
            time.sleep(0.3)
            proc.kill()
            t0 = time.monotonic()
            proc.communicate()
            while True:
                gpus = json.loads(d.get("/api/v1/gpus")[1])["gpus"]
                if gpus[0]["state"] == "free":
                    break
                if time.monotonic() - t0 > 60:
                    raise RuntimeError("the GPU did not become free within 60 s")
                time.sleep(0.005)
            out.append(time.monotonic() - t0)
            d.wait_free(1)
        return out
    finally:
        d.stop()


def info_times(n: int) -> list[float]:
    """Seconds for one `info` request from the Python client (what `gpupool status` sends)."""
    sys.path.insert(0, str(ROOT / "client"))
    from gpupool.config import ServerConfig
    from gpupool.wire.info import fetch_info

    d = Daemon(2)
    try:
        host, port = d.address.rsplit(":", 1)
        srv = ServerConfig(address=d.address, host=host, port=port, token=d.token,
                           tls=d.fingerprint is not None, tls_fingerprint=d.fingerprint or "")
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            res = fetch_info(srv, 10.0)
            out.append(time.perf_counter() - t0)
            if res.result != 0:
                raise RuntimeError(f"info refused: {res.message}")
        return out
    finally:
        d.stop()


def selection_times(client: Path, n: int) -> tuple[list[float], list[float]]:
    """cuInit times with one server configured, and with two (probes first), same daemons."""
    a, b = Daemon(1), Daemon(1)
    try:
        conf = a.state / "client.toml"
        conf.write_text(a.config_entry() + "\n" + b.config_entry())
        conf.chmod(0o600)  # it holds tokens
        two = dict(os.environ, LD_LIBRARY_PATH=str(BUILD / "client"), GPUPOOL_CONFIG=str(conf))
        for k in ("GPUPOOL_SERVER", "GPUPOOL_TOKEN", "GPUPOOL_TLS", "GPUPOOL_TLS_FINGERPRINT",
                  "GPUPOOL_TLS_CA"):
            two.pop(k, None)
        out: tuple[list[float], list[float]] = ([], [])
        for _ in range(n):
            for env, times in ((a.client_env(), out[0]), (two, out[1])):
                proc = subprocess.run([str(client), str(MIB), "0", "1"], env=env,
                                      capture_output=True, text=True, timeout=60)
                if proc.returncode != 0:
                    raise RuntimeError(proc.stderr)
                f = parse_facts(proc.stdout)
                times.append(float(f["t_leased"]) - float(f["t_start"]))
                a.wait_free(1)
        return out
    finally:
        a.stop()
        b.stop()


def raw_tcp_connect(n: int) -> list[float]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)

    def serve() -> None:
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            with c:
                data = c.recv(64)
                c.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        with socket.create_connection(srv.getsockname()) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.sendall(b"x" * 64)
            got = 0
            while got < 64:
                got += len(s.recv(64))
        out.append(time.perf_counter() - t0)
    srv.close()
    return out


def probe(d: Daemon, seconds: float) -> list[float]:
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        status, _ = d.get("/healthz")
        out.append(time.perf_counter() - t0)
        if status != 200:
            raise RuntimeError(f"/healthz answered {status}")
    return out


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def responsiveness(client: Path, seconds: float) -> tuple[list[float], list[float], float]:
    d = Daemon(2)
    procs: list[subprocess.Popen[str]] = []
    try:
        idle = probe(d, min(seconds, 5))
        for i in range(8):  # 2 stream copies, 6 wait in the queue
            procs.append(subprocess.Popen(
                [str(client), str(64 * MIB), str(int(seconds * 1000) + 3000), str(i + 1),
                 "1000000"], env=d.client_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True))
        time.sleep(1.5)
        t0 = time.monotonic()
        busy = probe(d, seconds)
        elapsed = time.monotonic() - t0
        import json

        leases = json.loads(d.get("/api/v1/leases?state=active")[1])["leases"]
        moved = sum(le["bytes_d2h"] for le in leases)
        return idle, busy, moved / max(elapsed, 1e-9)
    finally:
        for p in procs:
            p.kill()
            p.communicate()
        d.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--markdown", type=Path, help="also write the markdown section here")
    args = ap.parse_args()
    n = 8 if args.quick else 25
    seconds = 5.0 if args.quick else 15.0
    client = build_client()
    log("raw TCP connect + round trip")
    ref = raw_tcp_connect(200)
    log(f"connect to first reply, pre-started workers ({n} runs)")
    warm = connect_times(client, n, True)
    log(f"connect to first reply, workers started on demand ({n} runs)")
    cold = connect_times(client, n, False)
    log(f"info requests ({n * 4} runs)")
    info = info_times(n * 4)
    log(f"connect with one server and with two configured ({n} runs each)")
    one, two = selection_times(client, n)
    log("SIGKILL of a streaming client to GPU free again")
    recovery = kill_to_free(client, 3 if args.quick else 8)
    log(f"/healthz under load ({seconds:g} s)")
    idle, busy, rate = responsiveness(client, seconds)
    ms = 1000.0
    rows = [
        ("connect to first reply, pre-started worker (median)", statistics.median(warm) * ms,
         "ms", f"raw TCP connect + RTT {statistics.median(ref) * ms:.3f} ms", "small"),
        ("connect to first reply, pre-started worker (p90)", pct(warm, 90) * ms, "ms", "", ""),
        ("connect to first reply, worker started on demand (median)",
         statistics.median(cold) * ms, "ms", "", "(for comparison)"),
        ("info request, Python client (median)", statistics.median(info) * ms, "ms",
         f"raw TCP connect + RTT {statistics.median(ref) * ms:.3f} ms", ""),
        ("connect to first reply, 2 servers configured (median)", statistics.median(two) * ms,
         "ms", f"1 server: {statistics.median(one) * ms:.2f} ms", "small"),
        ("client SIGKILL to GPU free again (median)", statistics.median(recovery), "s",
         f"max {max(recovery):.2f} s of {len(recovery)}", "< 3 s"),
        ("/healthz p50 while streaming", pct(busy, 50) * ms, "ms",
         f"idle p50 {pct(idle, 50) * ms:.2f} ms", ""),
        ("/healthz p99 while streaming", pct(busy, 99) * ms, "ms",
         f"idle p99 {pct(idle, 99) * ms:.2f} ms", "< 100 ms"),
        ("/healthz max while streaming", max(busy) * ms, "ms", f"{len(busy)} probes", ""),
        ("copy throughput meanwhile (2 clients, D2H)", rate / (1 << 30), "GiB/s", "", ""),
    ]
    width = max(len(r[0]) for r in rows)
    for name, value, unit, ref_text, target in rows:
        print(f"{name:<{width}}  {value:10.3f} {unit:<6} {ref_text:<34} {target}")
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                             capture_output=True, text=True).stdout.strip()
    except OSError:
        rev = "?"
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    md = [f"### Daemon: connect time and responsiveness ({date}, commit {rev})", "",
          f"Machine: {platform.node()}, {os.cpu_count()} CPUs, {platform.platform()}; simulated "
          "GPUs over loopback. Command: `python bench/daemon_bench.py"
          f"{' --quick' if args.quick else ''}`.", "",
          "| metric | measured | reference (same run) | target |", "|---|---|---|---|"]
    for name, value, unit, ref_text, target in rows:
        md.append(f"| {name} | {value:.3f} {unit} | {ref_text} | {target} |")
    benchlib.emit_markdown(md, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
